"""The demo's prompts: beginnings of Python code, like the corpus the demo models were
trained on (no dependencies, so that benchmarks can import them alone)."""

PROMPTS: tuple[str, ...] = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef ",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n        return ",
    "def read_file(path):\n    with open(path) as f:\n",
    "import sys\n\n\ndef main(argv):\n    ",
    "    for i in range(len(self.items)):\n",
    "class Error(Exception):\n    \"\"\"",
)
