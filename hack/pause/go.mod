module specula.dev/pause

go 1.22
