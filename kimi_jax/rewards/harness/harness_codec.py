"""Tagged-JSON codec for values crossing the harness / candidate boundary (no pickle).

Runs inside the code sandbox under its Python 3 (standard library only).
"""

def encode(x, depth=0):
  if depth > 200:
    raise ValueError("value nested too deeply")
  if x is None or isinstance(x, (bool, str)):
    return x
  if isinstance(x, int):
    return x
  if isinstance(x, float):
    return {"f": repr(x)}
  if isinstance(x, complex):
    return {"c": [repr(x.real), repr(x.imag)]}
  if isinstance(x, list):
    return [encode(v, depth + 1) for v in x]
  if isinstance(x, tuple):
    return {"t": [encode(v, depth + 1) for v in x]}
  if isinstance(x, (set, frozenset)):
    tag = "s" if isinstance(x, set) else "z"
    return {tag: [encode(v, depth + 1) for v in x]}
  if isinstance(x, dict):
    return {"d": [[encode(k, depth + 1), encode(v, depth + 1)]
                  for k, v in x.items()]}
  if isinstance(x, bytes):
    return {"b": x.hex()}
  raise TypeError("unsupported value type %s" % type(x).__name__)

def decode(x):
  if isinstance(x, list):
    return [decode(v) for v in x]
  if not isinstance(x, dict):
    return x
  (tag, v), = x.items()
  if tag == "f":
    return float(v)
  if tag == "c":
    return complex(float(v[0]), float(v[1]))
  if tag == "t":
    return tuple(decode(i) for i in v)
  if tag == "s":
    return set(decode(i) for i in v)
  if tag == "z":
    return frozenset(decode(i) for i in v)
  if tag == "d":
    return {decode(k): decode(i) for k, i in v}
  if tag == "b":
    return bytes.fromhex(v)
  raise ValueError("bad tag")
