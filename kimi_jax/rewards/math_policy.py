"""Normalisation and a conservative acceptance policy around math-verify.

math-verify stays the engine (parsing LaTeX, symbolic and set comparison).
Around it this module (1) rewrites notations it misreads into ones it reads
right, and (2) decides the questions it answers too generously — when in
doubt it rejects, because an accepted wrong answer teaches the policy model
to be wrong while a rejected right one only costs a little signal. The rules,
with examples, are in docs/rewards.md ("Math answer policy"):

* exactness: every finite decimal is compared as the exact rational it
  writes (0.333333 != 1/3, 1.414214 != sqrt 2, 0.5 == 1/2); repeating
  decimals (0.\\overline{3}, 0.\\bar{3}, 0.(3), 0.333\\ldots) are exact
  rationals; a non-repeating decimal followed by an ellipsis is rejected;
* shape: a set (`\\{..\\}` or a bare list) never equals an ordered tuple, a
  tuple compares in order, an inequality equals an interval only when the
  reference is unambiguously an interval or an inequality;
* units: a trailing unit is split off; both sides with known units of the
  same dimension are converted exactly (5 m == 500 cm, 5 m != 5 cm), unknown
  units must match as text, and a bare number is read in the reference's
  unit; degrees and radians convert (90^\\circ == \\pi/2);
* notation: `i`, `\\sqrt{-1}` and `e^{i\\pi}` are complex, `\\varnothing` is
  `\\emptyset`, `3e5` is scientific notation, `1\\,000` is one number, and a
  trailing parenthetical remark ("(the positive root)") is dropped unless it
  hedges ("(or 6)").

Everything here is linear-time string work on answers capped in length
(`max_answer_chars`), plus the math-verify calls, which run under the
worker pool's deadline (`verify_pool.py`).
"""

from __future__ import annotations

import dataclasses
import fractions
import logging
import re
from typing import Any, Sequence

from kimi_jax.rewards.math_extract import (DEFAULT_ANSWER_PATTERNS,
                                           DEFAULT_BOXED_COMMANDS,
                                           clean_answer, extract_answer,
                                           extract_boxed)


@dataclasses.dataclass(frozen=True)
class CheckOptions:
  """What one check needs (sent to the worker with each task)."""
  boxed_commands: tuple[str, ...] = DEFAULT_BOXED_COMMANDS
  answer_patterns: tuple[str, ...] = DEFAULT_ANSWER_PATTERNS
  max_answer_chars: int = 1_000


class Rejected(Exception):
  """The policy rejects the answer without asking math-verify."""


# ----------------------------------------------------------------------------
# Notation rewrites (pure string functions).

_EMPTY = re.compile(r"\\(?:varnothing|emptyset)(?![a-zA-Z])|∅")
_ANGLE = re.compile(r"(?:\\left\s*)?\\langle(?![a-zA-Z])|"
                    r"(?:\\right\s*)?\\rangle(?![a-zA-Z])|[⟨⟩]")
_GROUP_SEP = r"(?:\\[,;:! ]|\\thinspace(?![a-zA-Z])\s*|~|\{,\})"
_DIGIT_GROUPS = re.compile(
    rf"(?<![\d.])(\d{{1,3}})((?:{_GROUP_SEP}\d{{3}})+)(?![\d])")
_COMMA_NUMBER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SCIENTIFIC = re.compile(
    r"(?<![\w.\\])(\d+(?:\.\d+)?|\.\d+)\s*[eE]\s*([+-]?\d+)(?![\w.])")
_REPEAT_BAR = re.compile(
    r"(?<![\d.])(\d*)\.(\d*)\s*\\(?:overline|bar|dot)\s*"
    r"(?:\{\s*(\d+)\s*\}|(\d))")
_REPEAT_PAREN = re.compile(r"(?<![\d.])(\d*)\.(\d*)\((\d+)\)")
_ELLIPSIS = re.compile(
    r"(?<![\d.])(\d*)\.(\d+)\s*(?:\\ldots|\\dots|\\cdots|\.\.\.|…)"
    r"(?![a-zA-Z])")
_DECIMAL = re.compile(r"(?<![\d.])(\d*)\.(\d+)(?![\d.])")


def _frac(value: fractions.Fraction) -> str:
  if value.denominator == 1:
    return str(value.numerator)
  # Parenthesised, not braced: math-verify reads a top-level `{x}` as a set.
  return f"(\\frac{{{value.numerator}}}{{{value.denominator}}})"


def repeating_value(integer: str, fixed: str, period: str
                    ) -> fractions.Fraction:
  """The exact value of `integer.fixed(period)(period)...`."""
  base = fractions.Fraction(int(integer or "0"))
  head = fractions.Fraction(int(fixed or "0"), 10 ** len(fixed))
  tail = fractions.Fraction(int(period),
                            10 ** len(fixed) * (10 ** len(period) - 1))
  return base + head + tail


def period_of(digits: str) -> tuple[str, str] | None:
  """(fixed, period) when `digits` ends in at least two full repetitions of
  a period (an optional partial one after), e.g. "1666" -> ("1", "6"),
  "121212" -> ("", "12"); None when no period shows (`3.14159...`)."""
  n = len(digits)
  for start in range(n):
    tail = digits[start:]
    for p in range(1, len(tail) // 2 + 1):
      period = tail[:p]
      reps = len(tail) // p
      if reps >= 2 and (period * (reps + 1)).startswith(tail):
        return digits[:start], period
  return None


def _rewrite_ellipsis(m: re.Match) -> str:
  found = period_of(m.group(2))
  if found is None:
    raise Rejected("a decimal cut off with an ellipsis is an approximation")
  return _frac(repeating_value(m.group(1), *found))


def rewrite_notation(text: str) -> str:
  """Rewrites notations math-verify misreads; exact decimals last."""
  text = _EMPTY.sub(r"\\emptyset ", text)
  text = _ANGLE.sub(lambda m: "(" if "langle" in m.group(0) or
                    m.group(0) == "⟨" else ")", text)
  text = _DIGIT_GROUPS.sub(
      lambda m: m.group(1) + re.sub(r"\D", "", m.group(2)), text)
  if _COMMA_NUMBER.fullmatch(text.strip()):
    text = text.replace(",", "")
  text = _SCIENTIFIC.sub(r"(\1\\times 10^{\2})", text)
  text = _REPEAT_BAR.sub(lambda m: _frac(repeating_value(
      m.group(1), m.group(2), m.group(3) or m.group(4))), text)
  text = _REPEAT_PAREN.sub(lambda m: _frac(repeating_value(
      m.group(1), m.group(2), m.group(3))), text)
  text = _ELLIPSIS.sub(_rewrite_ellipsis, text)
  return _DECIMAL.sub(lambda m: _frac(fractions.Fraction(
      int(m.group(1) + m.group(2)), 10 ** len(m.group(2)))), text)


# ----------------------------------------------------------------------------
# Trailing remarks.

_REMARK = re.compile(
    r"(?:\s|\\[,;:!]|\\q?quad(?![a-zA-Z]))+"
    r"(?:\\text\s*\{\s*\(([^{}()]*)\)\s*\}|\(([^{}()]*)\))\s*$")
_WORD = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}")
_TEXT_WRAPPER = re.compile(r"\\(?:text|mbox|textrm|mathrm)\s*\{([^{}]*)\}")
_HEDGES = frozenset({"or", "and", "also", "maybe", "possibly", "either",
                     "alternatively", "otherwise", "perhaps", "not"})
# Words that turn a trailing "unit" into a hedge or an estimate.
_QUALIFIERS = _HEDGES | {"more", "less", "least", "most", "approximately",
                         "approx", "about", "roughly", "nearly", "around",
                         "over", "under", "than", "almost", "close", "circa",
                         "estimated", "rounded"}


def strip_remark(text: str) -> str:
  """Drops a trailing parenthetical remark in words ("5 (the positive
  root)"), but never one that hedges ("5 (or 6)") or states a value."""
  m = _REMARK.search(text)
  if m is None:  # `5 \\text{ (since } x>0)`: look through \\text wrappers
    flat = _TEXT_WRAPPER.sub(r" \1", text)
    if flat == text or _REMARK.search(flat) is None:
      return text
    text = flat
    m = _REMARK.search(text)
  inner = m.group(1) if m.group(1) is not None else m.group(2)
  words = [w.lower() for w in _WORD.findall(inner)]
  wordy = any(len(w) >= 4 for w in words) or len(words) >= 2
  if not wordy or _HEDGES.intersection(words) or "=" in inner:
    return text
  head = text[:m.start()].rstrip()
  return head if head else text


# ----------------------------------------------------------------------------
# Units.


@dataclasses.dataclass(frozen=True)
class Unit:
  """A trailing unit: `dims` maps base dimensions to powers (empty for an
  unknown unit, which then only equals the same `text`); `scale` converts
  to the base unit (a sympy number)."""
  text: str
  dims: tuple[tuple[str, int], ...]
  scale: Any


def _unit_table() -> dict[str, tuple[str, Any]]:
  import sympy
  r = sympy.Rational
  entries = {
      "length": {("m", "meter", "meters", "metre", "metres"): 1,
                 ("cm", "centimeter", "centimeters", "centimetre",
                  "centimetres"): r(1, 100),
                 ("mm", "millimeter", "millimeters", "millimetre",
                  "millimetres"): r(1, 1000),
                 ("km", "kilometer", "kilometers", "kilometre",
                  "kilometres"): 1000,
                 ("nm", "nanometer", "nanometers"): r(1, 10 ** 9),
                 ("in", "inch", "inches"): r(254, 10000),
                 ("ft", "foot", "feet"): r(3048, 10000),
                 ("yd", "yard", "yards"): r(9144, 10000),
                 ("mi", "mile", "miles"): r(1609344, 1000)},
      "mass": {("g", "gram", "grams"): 1,
               ("kg", "kilogram", "kilograms"): 1000,
               ("mg", "milligram", "milligrams"): r(1, 1000),
               ("lb", "lbs", "pound", "pounds"): r(45359237, 100000)},
      "time": {("s", "sec", "secs", "second", "seconds"): 1,
               ("ms", "millisecond", "milliseconds"): r(1, 1000),
               ("min", "mins", "minute", "minutes"): 60,
               ("h", "hr", "hrs", "hour", "hours"): 3600,
               ("day", "days"): 86400,
               ("week", "weeks"): 604800},
      "angle": {("deg", "degree", "degrees", "°"): sympy.pi / 180,
                ("rad", "radian", "radians"): 1},
      "volume": {("L", "liter", "liters", "litre", "litres"): r(1, 1000),
                 ("mL", "ml", "milliliter", "milliliters", "millilitre",
                  "millilitres"): r(1, 10 ** 6)},
      "money": {("dollar", "dollars", "$"): 1,
                ("cent", "cents"): r(1, 100)},
  }
  table = {}
  for dim, units in entries.items():
    for names, scale in units.items():
      for name in names:
        table[name] = (dim, sympy.sympify(scale))
  return table


_TABLE: dict[str, tuple[str, Any]] | None = None
# Volume is length^3; litres convert to cubic metres.
_DERIVED = {"volume": (("length", 3),)}
_FUNCTION_WORDS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "max",
    "min", "det", "gcd", "lcm", "mod", "arcsin", "arccos", "arctan", "sinh",
    "cosh", "tanh", "lim", "sup", "inf", "deg"})
_TEXT_CMD = (r"\\(?:text|mathrm|textrm|mbox|rm|operatorname|textnormal|"
             r"mathit|mathsf)\s*\{([^{}]*)\}")
# Unit tokens, each matched at the end of the remaining text.
_TAIL_SPACE = re.compile(r"(?:\s|\\[,;:! ]|~|\\q?quad(?![a-zA-Z]))+$")
_TAIL_TEXT = re.compile(_TEXT_CMD + r"$")
_TAIL_DEGREE = re.compile(r"(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)$")
_TAIL_POWER = re.compile(r"\^\s*(?:\{\s*(-?\d)\s*\}|(\d))$")
_TAIL_WORD = re.compile(r"(?<![\\a-zA-Z])([a-zA-Z]{1,20})$")
_TAIL_SLASH = re.compile(r"(?:/|\\cdot(?![a-zA-Z]))$")
_DOLLAR = re.compile(r"^\s*\\\$\s*|^\s*\$\s*(?=\d)")


def _known(name: str) -> tuple[str, Any] | None:
  global _TABLE
  if _TABLE is None:
    _TABLE = _unit_table()
  return _TABLE.get(name) or (_TABLE.get(name.lower()) if len(name) > 3
                              else None)


def _tail_tokens(text: str) -> tuple[str, list[str]]:
  """Splits trailing unit tokens off `text`: (head, tokens left to right).

  A bare word counts only when it is a known unit after a space (so `2x`
  and `2 x` stay algebra) or a word of 3+ letters that names no function.
  """
  tokens: list[str] = []
  while True:
    m = _TAIL_SPACE.search(text)
    if m:
      text = text[:m.start()]
    for kind, pattern in (("text", _TAIL_TEXT), ("deg", _TAIL_DEGREE),
                          ("pow", _TAIL_POWER), ("word", _TAIL_WORD),
                          ("slash", _TAIL_SLASH)):
      m = pattern.search(text)
      if not m:
        continue
      if kind == "word":
        word, before = m.group(1), text[:m.start()]
        spaced = not before or before[-1].isspace() or before.endswith(
            ("\\,", "\\;", "\\ ", "~", "}", "/", "\\cdot"))
        unit_like = _known(word) is not None and spaced and (
            len(word) > 1 or before.endswith((" ", "\\,", "\\;", "\\ ", "~")))
        wordy = len(word) >= 3 and word.lower() not in _FUNCTION_WORDS
        if not (unit_like or (wordy and spaced)):
          continue
      if kind == "pow" and not tokens and not _looks_unit_before(
          text[:m.start()]):
        continue
      if kind == "slash" and not tokens:
        continue
      tokens.insert(0, (kind, m.group(0), m.groups()))
      text = text[:m.start()]
      break
    else:
      return text, tokens


def _looks_unit_before(text: str) -> bool:
  """A trailing `^2` belongs to a unit only right after a unit (`\\text{cm}^2`,
  `5 cm^2`), never after algebra (`x^2`)."""
  text = text.rstrip()
  if _TAIL_TEXT.search(text):
    return True
  m = _TAIL_WORD.search(text)
  return bool(m) and _known(m.group(1)) is not None and (
      text[:m.start()][-1:].isspace())


def _factors(tokens: list) -> list[tuple[str, int]]:
  """Unit tokens -> [(name, power)], `/` flipping the sign of what follows."""
  out: list[tuple[str, int]] = []
  sign = 1
  for kind, raw, groups in tokens:
    if kind == "slash":
      sign = -1 if raw == "/" else sign
    elif kind == "pow":
      power = int(groups[0] or groups[1])
      if out:
        out[-1] = (out[-1][0], out[-1][1] * power)
    elif kind == "deg":
      out.append(("°", sign))
    elif kind == "word":
      out.append((groups[0], sign))
    else:  # text command: its words, with `/` and `^n` inside
      inner = groups[0]
      for part in re.finditer(r"(/)|\^\s*\{?\s*(-?\d)\s*\}?|([^\s/^*·.]+)",
                              inner):
        if part.group(1):
          sign = -1
        elif part.group(2):
          if out:
            out[-1] = (out[-1][0], out[-1][1] * int(part.group(2)))
        else:
          out.append((part.group(3), sign))
  # "°C" / "°F" are temperatures (offset scales): opaque units.
  merged: list[tuple[str, int]] = []
  for name, power in out:
    if merged and merged[-1][0] == "°" and name in ("C", "F"):
      merged[-1] = ("°" + name, power)
    else:
      merged.append((name, power))
  return merged


def split_unit(text: str) -> tuple[str, Unit | None]:
  """(value, unit) of an answer; unit None when there is none."""
  dollar = _DOLLAR.search(text)
  if dollar:
    text = text[dollar.end():]
  head, tokens = _tail_tokens(text)
  if not tokens or not re.search(r"[\d\w}]", head):
    return text, (Unit("$", (("money", 1),), 1) if dollar else None)
  factors = _factors(tokens)
  if dollar:
    factors.insert(0, ("$", 1))
  return head.strip(), _unit_of(factors)


def _unit_of(factors: list[tuple[str, int]]) -> Unit | None:
  import sympy
  if not factors:
    return None
  dims: dict[str, int] = {}
  scale = sympy.Integer(1)
  names = []
  known = True
  for name, power in factors:
    names.append(name.lower() if len(name) > 3 else name)
    if power != 1:
      names[-1] += f"^{power}"
    entry = _known(name)
    if entry is None:
      known = False
      continue
    dim, factor = entry
    for base, p in _DERIVED.get(dim, ((dim, 1),)):
      dims[base] = dims.get(base, 0) + p * power
    scale = scale * factor ** power
  text = " ".join(names)
  if not known:
    if _QUALIFIERS.intersection(n.lower() for n in names):
      raise Rejected(f"a qualified answer ({text!r})")
    return Unit(text, (), None)
  return Unit(text, tuple(sorted((k, v) for k, v in dims.items() if v)),
              scale)


# ----------------------------------------------------------------------------
# Answer shapes.

_SIZING = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|bigg|Bigg)"
                     r"(?![a-zA-Z])\s*")
_RELATION = re.compile(r"<|>|\\(?:le|ge|leq|geq|lt|gt|leqslant|geqslant|ne|"
                       r"neq)(?![a-zA-Z])|≤|≥|≠")


def _top_level(text: str) -> tuple[int, int]:
  """(commas at depth 0, index where the first bracket group closes)."""
  depth = 0
  commas = 0
  first_close = -1
  i, n = 0, len(text)
  while i < n:
    ch = text[i]
    if ch == "\\" and i + 1 < n and text[i + 1] in "{}":
      depth += 1 if text[i + 1] == "{" else -1
      if depth == 0 and first_close < 0:
        first_close = i + 1
      i += 2
      continue
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0 and first_close < 0:
        first_close = i
    elif ch == "," and depth == 0:
      commas += 1
    i += 1
  return commas, first_close


def shape(text: str) -> str:
  """One of: set, list, pair, tuple, interval, relation, scalar."""
  s = _SIZING.sub("", text).strip()
  if s.startswith("\\emptyset") and s[len("\\emptyset"):].strip() == "":
    return "set"
  if "\\in" in s and re.search(r"\\in(?![a-zA-Z])", s):
    return shape(re.split(r"\\in(?![a-zA-Z])", s, maxsplit=1)[1])
  commas, first_close = _top_level(s)
  has_infinity = "\\infty" in s or "∞" in s
  if re.search(r"\\cup(?![a-zA-Z])|∪", s):
    return "interval"
  if s.startswith("\\{") and first_close == len(s) - 1:
    return "set"
  if s[:1] in "([" and s[-1:] in ")]" and first_close == len(s) - 1:
    inner_commas, _ = _top_level(s[1:-1])
    if inner_commas == 1:
      if has_infinity or s[0] != "(" or s[-1] != ")":
        return "interval"
      return "pair"
    if inner_commas > 1:
      return "tuple"
  if commas:
    return "list"
  if _RELATION.search(s) and "=" not in s:
    return "relation"
  return "scalar"


_ALLOWED = {
    # reference shape -> prediction shapes judged by math-verify
    "set": {"set", "list", "scalar"},
    "list": {"set", "list", "scalar"},
    "pair": {"pair", "list"},
    "tuple": {"tuple", "pair", "list"},
    "interval": {"interval", "pair", "relation"},
    "relation": {"relation", "interval", "pair"},
    "scalar": {"scalar", "set", "list"},
}


def shape_policy(gold_shape: str, pred_shape: str, pred: str
                 ) -> tuple[str, bool]:
  """(prediction text to compare, allow interval <-> inequality) or raises
  Rejected when the shapes cannot denote the same answer."""
  if pred_shape not in _ALLOWED[gold_shape]:
    raise Rejected(f"a {pred_shape} answer for a {gold_shape} reference")
  if pred_shape == "list" and gold_shape in ("pair", "tuple"):
    return f"({pred})", False  # a bare list keeps the order it was written
  if pred_shape == "list" and gold_shape == "set":
    return f"\\{{{pred}\\}}", False
  return pred, gold_shape == "interval" and pred_shape == "relation"


# ----------------------------------------------------------------------------
# The check.


def _parse(latex: str) -> list[Any]:
  from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
  # The answer is already isolated, so present it as one inline-math span.
  return parse(f"${latex}$",
               extraction_config=[LatexExtractionConfig(),
                                  ExprExtractionConfig()],
               parsing_timeout=None)


def _exact(parsed: Sequence[Any]) -> list[Any]:
  """`i` is the imaginary unit; leftover floats become exact rationals."""
  import sympy
  out = []
  for x in parsed:
    if isinstance(x, (sympy.Basic, sympy.MatrixBase)):
      try:
        floats = x.atoms(sympy.Float)
        if floats:
          x = x.xreplace({f: sympy.Rational(str(f)) for f in floats})
        imaginary = {s: sympy.I for s in x.free_symbols if s.name == "i"}
        if imaginary or any(p.base.is_negative and not p.exp.is_integer
                            for p in x.atoms(sympy.Pow)):
          x = x.xreplace(imaginary).doit()
      except Exception:  # noqa: BLE001 - keep math-verify's object
        pass
    out.append(x)
  return out


def _scaled(parsed: Sequence[Any], factor: Any) -> list[Any]:
  import sympy
  return [x * factor if isinstance(x, sympy.Expr) else x for x in parsed
          if isinstance(x, sympy.Expr)]


def _unit_factors(gold_unit: Unit | None, pred_unit: Unit | None
                  ) -> list[Any]:
  """Factors f such that pred * f, in the reference's unit, may equal gold;
  raises Rejected when the units cannot match."""
  import sympy
  angle = (("angle", 1),)
  if gold_unit is None and pred_unit is None:
    return [1]
  if pred_unit is None:  # a bare number is read in the reference's unit
    if gold_unit.dims == angle and gold_unit.scale != 1:
      return [1, 180 / sympy.pi]  # degrees, or radians
    return [1]
  if gold_unit is None:
    if pred_unit.dims == angle and pred_unit.scale != 1:
      return [1, sympy.pi / 180]
    return [1]
  if not gold_unit.dims or not pred_unit.dims:
    if gold_unit.text == pred_unit.text:
      return [1]
    raise Rejected(f"unit {pred_unit.text!r} for a reference in "
                   f"{gold_unit.text!r}")
  if gold_unit.dims != pred_unit.dims:
    raise Rejected(f"unit {pred_unit.text!r} (another dimension than "
                   f"{gold_unit.text!r})")
  return [pred_unit.scale / gold_unit.scale]


def _prepare(answer: str) -> tuple[str, Unit | None]:
  answer = strip_remark(clean_answer(answer))
  value, unit = split_unit(answer)
  return rewrite_notation(value), unit


UNPARSED = "answer did not parse"


def judge(gold: str, answer: str) -> tuple[bool, str | None]:
  """(correct, reason) for an extracted answer against the reference."""
  from math_verify import verify
  gold_value, gold_unit = _prepare(gold)
  try:
    pred_value, pred_unit = _prepare(answer)
  except Rejected as e:
    return False, str(e)
  gold_parsed = _exact(_parse(gold_value))
  if not gold_parsed:
    raise ValueError("reference answer did not parse")
  try:
    factors = _unit_factors(gold_unit, pred_unit)
    pred_text, set_relation = shape_policy(shape(gold_value),
                                           shape(pred_value), pred_value)
  except Rejected as e:
    return False, str(e)
  pred_parsed = _exact(_parse(pred_text))
  if not pred_parsed:
    # Said apart from a wrong answer: a reward model may judge it instead
    # (kimi_jax/reward_models: "verifier when it parses, model otherwise").
    return False, UNPARSED
  for factor in factors:
    candidate = pred_parsed if factor == 1 else _scaled(pred_parsed, factor)
    if candidate and verify(gold_parsed, candidate, float_rounding=6,
                            strict=True, timeout_seconds=None,
                            allow_set_relation_comp=set_relation):
      return True, None
  return False, None


def check_answer(gold: str, response: str,
                 options: CheckOptions) -> dict[str, Any]:
  """Extracts the response's answer and judges it against `gold`.

  Returns `{"correct", "answer", "reason"?, "error"?}`. No timeout of its
  own: run it through `verify_pool.VerifyPool`.
  """
  answer = extract_answer(response, options.boxed_commands,
                          options.answer_patterns)
  if answer is None:
    return {"correct": False, "answer": None, "error": "no answer found"}
  if len(answer) > options.max_answer_chars:
    return {"correct": False, "answer": answer[:64] + "...",
            "error": "answer too long"}
  if len(gold) > options.max_answer_chars:
    return {"correct": False, "answer": answer, "error": "reference too long"}
  gold_boxed = extract_boxed(gold, options.boxed_commands)
  try:
    ok, reason = judge(gold_boxed if gold_boxed else gold, answer)
  except (ValueError, Rejected) as e:
    return {"correct": False, "answer": answer,
            "error": f"reference answer: {e}"}
  out: dict[str, Any] = {"correct": ok, "answer": answer}
  if reason:
    out["reason"] = reason
  return out


# Typical answers checked once in the pool's template process: the LaTeX
# parser (ANTLR) builds its prediction cache lazily, and the first parse of
# a shape costs seconds.
_WARM_UP_PAIRS = (("a^2-4", "\\boxed{(a+2)(a-2)}"),
                  ("\\frac{1}{2}", "\\boxed{0.5}"),
                  ("[1,3)", "\\boxed{[1, 3)}"),
                  ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}"),
                  ("5\\text{ m}", "\\boxed{500 \\text{ cm}}"),
                  ("i", "\\boxed{\\sqrt{-1}}"),
                  ("x=2", "Answer: 2"))


def warm_up() -> None:
  # math-verify warns once that its own timeout is off; the pool is the
  # timeout.
  logging.getLogger("math_verify").setLevel(logging.CRITICAL)
  options = CheckOptions()
  for gold, response in _WARM_UP_PAIRS:
    check_answer(gold, response, options)
