"""The candidate's process in function mode: loads the response's code, then
answers call requests from the driver over two pipes.

Runs inside the code sandbox under its Python 3 (standard library only).
"""

import json
import os
import sys

from harness_codec import decode, encode

def main():
  req = os.fdopen(int(sys.argv[1]), "r")
  resp = os.fdopen(int(sys.argv[2]), "w")
  def send(msg):
    resp.write(json.dumps(msg) + "\n")
    resp.flush()
  ns = {"__name__": "solution", "__builtins__": __builtins__}
  try:
    with open("solution.py") as f:
      source = f.read()
    exec(compile(source, "solution.py", "exec"), ns)
  except BaseException as e:
    send({"error": "load: %s: %s" % (type(e).__name__, str(e)[:300])})
    return
  send({"ready": True})
  for line in req:
    msg = json.loads(line)
    try:
      fn = ns[msg["name"]]
      value = fn(*decode(msg["args"]), **decode(msg["kwargs"]))
      out = {"value": encode(value)}
    except BaseException as e:
      out = {"error": "%s: %s" % (type(e).__name__, str(e)[:300])}
    send(out)

main()
