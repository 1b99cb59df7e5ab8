"""The client that runs inside the cluster, in a pod of the operator image (python and
httpx): its source is passed to ``python -c``.

Usage: python -c SOURCE BASE_URL PROMPT MAX_TOKENS [loop]

Prints one JSON line per completion request: ``{"ok": true, "text": ...}`` or
``{"ok": false, "error": ...}``, after a first line ``{"model": NAME}``.  Without
``loop`` it sends one request; with it, it sends requests back to back, each on a
new connection (as independent clients would), until the file ``/tmp/stop`` exists,
then prints ``{"done": N}`` and exits 0.  ``$API_KEY``, when set (from the resource's
API-key Secret), is sent as ``Authorization: Bearer``.
"""

import json
import os
import sys

import httpx

base, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
loop = len(sys.argv) > 4 and sys.argv[4] == "loop"
headers = {"Authorization": f"Bearer {os.environ['API_KEY']}"} if os.environ.get("API_KEY") else {}
model = None
while model is None:
    try:
        model = httpx.get(base + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - reported, then retried only when looping
        print(json.dumps({"ok": False, "error": f"models: {exc!r}"}), flush=True)
        if not loop:
            sys.exit(1)
print(json.dumps({"model": model}), flush=True)
body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
sent = 0
while True:
    try:
        response = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
        if response.status_code == 200:
            line = {"ok": True, "text": response.json()["choices"][0]["text"]}
        else:
            line = {"ok": False, "error": f"HTTP {response.status_code}: {response.text[:300]}"}
    except Exception as exc:  # noqa: BLE001 - every failure is reported
        line = {"ok": False, "error": repr(exc)}
    sent += 1
    print(json.dumps(line), flush=True)
    if not loop or os.path.exists("/tmp/stop"):
        break
print(json.dumps({"done": sent}), flush=True)
