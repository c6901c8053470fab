"""Tool environments with verifiable rewards, generated from a seed.

Two task families, both answered through tools the model calls in text:

  calc    multi-step arithmetic word problems; the tool evaluates integer
          expressions:   <calc>12*7</calc>  ->  <result>84</result>
  lookup  a synthetic key-value store per task, where the answer needs chained
          lookups (each value is the next key until a number comes back):
                          <lookup>kab</lookup>  ->  <result>zor</result>
The model ends with <answer>...</answer>; the reward is 1 for an exact match
of the stripped answer text, else 0.

Two difficulty levels (DIFFICULTIES):
  standard  calc: (a * b) +/- c in a word problem, two calculator calls;
            lookup: three chained lookups among four distractor keys.
  easy      calc: one call, "Q: a+b=?" (or a-b) with operands 2..39;
            lookup: one lookup of the key named in the prompt among two
            distractors. Short prompts whose operands sit right before the
            turn, so a small model learns to copy them within a CPU warm-up.

`parse_action` turns any text the model produced into an Action and never
raises: a malformed call becomes an error observation that goes into the
context (`Environment.observe`), like a tool's output.

Splits: a task is a pure function of (seed, split, index, difficulty).
Held-out calculator problems draw every operand from numbers that train
problems never use (n % 4 == 3 vs the rest); held-out stores come from their
own random streams. Standard held-out keys start with a letter train keys
never contain ('q'); easy keys are split by their letters' sum (% 4 == 3
held out), so every letter is seen in training but no held-out key is.
Ground floor: numpy only.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

SPLITS = ("train", "heldout")
KINDS = ("calc", "lookup")
DIFFICULTIES = ("standard", "easy")
# Closing tags that end a model turn (the rollout stops sampling there).
STOP_TAGS = ("</calc>", "</lookup>", "</answer>")
MAX_EXPR_CHARS = 48
_NUMBER = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True)
class Task:
  """One problem: the prompt text, the exact answer and a worked solution.

  demo: the solution as (text, own) segments after the prompt: own=True is
    what the model writes (tool calls, the answer), own=False a tool output.
  store: the key-value store of a lookup task ({} for calc).
  """
  kind: str
  prompt: str
  answer: str
  demo: tuple[tuple[str, bool], ...]
  store: dict = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class Action:
  """What a model turn asked for: kind in {calc, lookup, answer, error}."""
  kind: str
  arg: str


def _rng(seed: int, split: str, index: int, kind: str,
         difficulty: str = "standard") -> np.random.Generator:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  if difficulty not in DIFFICULTIES:
    raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got "
                     f"{difficulty!r}")
  stream = [seed, SPLITS.index(split), KINDS.index(kind), index]
  # The standard level keeps its original streams.
  if difficulty != "standard":
    stream.append(DIFFICULTIES.index(difficulty))
  return np.random.default_rng(stream)


# ----------------------------------------------------------------------------
# The calculator.
# ----------------------------------------------------------------------------

class CalcError(ValueError):
  """An expression the calculator cannot evaluate."""


def evaluate_expression(expr: str) -> int:
  """Integer value of an expression of + - * and parentheses.

  A recursive-descent parser (no eval): raises CalcError on anything else,
  including expressions longer than MAX_EXPR_CHARS or results over 10**12.
  """
  s = expr.replace(" ", "")
  if not s:
    raise CalcError("empty expression")
  if len(s) > MAX_EXPR_CHARS:
    raise CalcError("expression too long")
  pos = 0

  def peek():
    return s[pos] if pos < len(s) else ""

  def number():
    nonlocal pos
    start = pos
    while peek().isdigit():
      pos += 1
    if start == pos:
      raise CalcError(f"expected a number at {pos}")
    return int(s[start:pos])

  def atom():
    nonlocal pos
    if peek() == "(":
      pos += 1
      v = expression()
      if peek() != ")":
        raise CalcError("unbalanced parentheses")
      pos += 1
      return v
    if peek() == "-":
      pos += 1
      return -atom()
    return number()

  def term():
    nonlocal pos
    v = atom()
    while peek() == "*":
      pos += 1
      v *= atom()
      if abs(v) > 10**12:
        raise CalcError("result too large")
    return v

  def expression():
    nonlocal pos
    v = term()
    while peek() in ("+", "-"):
      op = peek()
      pos += 1
      v = v + term() if op == "+" else v - term()
    return v

  value = expression()
  if pos != len(s):
    raise CalcError(f"unexpected {s[pos]!r} at {pos}")
  return value


def _operands(rng: np.random.Generator, split: str, n: int,
              lo: int = 2, hi: int = 40) -> list[int]:
  pool = [x for x in range(lo, hi) if (x % 4 == 3) == (split == "heldout")]
  return [int(v) for v in rng.choice(pool, size=n)]


_CALC_TEMPLATES = (
    # (question, first expression, second op): result = (a*b) op c
    ("{who} has {a} bags of {b} apples and gives away {c}. How many apples "
     "are left?", "-"),
    ("{who} buys {a} boxes of {b} pens and finds {c} more. How many pens "
     "now?", "+"),
    ("A shelf has {a} rows of {b} books; {c} books are taken. How many "
     "books remain?", "-"),
)
_NAMES = ("Ann", "Bob", "Eve", "Tom", "Sue", "Max")


def calc_task(seed: int, split: str, index: int) -> Task:
  """A two-step word problem: (a * b) then +/- c, with the calculator."""
  rng = _rng(seed, split, index, "calc")
  a, b, c = _operands(rng, split, 3)
  question, op = _CALC_TEMPLATES[int(rng.integers(len(_CALC_TEMPLATES)))]
  who = _NAMES[int(rng.integers(len(_NAMES)))]
  prod = a * b
  answer = prod - c if op == "-" else prod + c
  demo = ((f"<calc>{a}*{b}</calc>", True), (f"<result>{prod}</result>", False),
          (f"<calc>{prod}{op}{c}</calc>", True),
          (f"<result>{answer}</result>", False),
          (f"<answer>{answer}</answer>", True))
  prompt = "Q: " + question.format(who=who, a=a, b=b, c=c) + "\n"
  return Task("calc", prompt, str(answer), demo)


def easy_calc_task(seed: int, split: str, index: int) -> Task:
  """One call: "Q: a+b=?" or "Q: a-b=?" (a > b), answered with the result."""
  rng = _rng(seed, split, index, "calc", "easy")
  a, b = sorted(_operands(rng, split, 2), reverse=True)
  op = "+-"[int(rng.integers(2))]
  answer = a + b if op == "+" else a - b
  demo = ((f"<calc>{a}{op}{b}</calc>", True),
          (f"<result>{answer}</result>", False),
          (f"<answer>{answer}</answer>", True))
  return Task("calc", f"Q: {a}{op}{b}=?\n", str(answer), demo)


# ----------------------------------------------------------------------------
# The key-value store.
# ----------------------------------------------------------------------------

_TRAIN_LETTERS = "bcdfghjklmnprstvwxz"
_VOWELS = "aeiou"


def _key(rng: np.random.Generator, split: str) -> str:
  consonant = lambda: _TRAIN_LETTERS[int(rng.integers(len(_TRAIN_LETTERS)))]
  vowel = _VOWELS[int(rng.integers(len(_VOWELS)))]
  first = "q" if split == "heldout" else consonant()
  return first + vowel + consonant()


def _easy_key(rng: np.random.Generator, split: str) -> str:
  """A consonant-vowel-consonant key of the split's half (letter sum % 4)."""
  while True:
    c1, c2 = (_TRAIN_LETTERS[int(rng.integers(len(_TRAIN_LETTERS)))]
              for _ in range(2))
    k = c1 + _VOWELS[int(rng.integers(len(_VOWELS)))] + c2
    if (sum(map(ord, k)) % 4 == 3) == (split == "heldout"):
      return k


def lookup_task(seed: int, split: str, index: int, hops: int = 3,
                distractors: int = 4) -> Task:
  """A store where key_0 -> key_1 -> ... -> a number; answer: the number."""
  rng = _rng(seed, split, index, "lookup")
  keys = _distinct_keys(rng, split, hops + distractors, _key)
  value = str(int(rng.integers(10, 1000)))
  chain = keys[:hops]
  store = {k: nxt for k, nxt in zip(chain, chain[1:] + [value])}
  for k in keys[hops:]:
    store[k] = str(int(rng.integers(10, 1000)))
  demo = []
  for k in chain:
    demo += [(f"<lookup>{k}</lookup>", True),
             (f"<result>{store[k]}</result>", False)]
  demo.append((f"<answer>{value}</answer>", True))
  prompt = (f"Q: Look up {chain[0]} and follow the keys until a number. "
            "Which number?\n")
  return Task("lookup", prompt, value, tuple(demo), store)


def _distinct_keys(rng, split: str, n: int, draw) -> list[str]:
  keys: list[str] = []
  while len(keys) < n:
    k = draw(rng, split)
    if k not in keys:
      keys.append(k)
  return keys


def easy_lookup_task(seed: int, split: str, index: int,
                     distractors: int = 2) -> Task:
  """One lookup: "Q: value of kab?" in a store of 1 + distractors keys."""
  rng = _rng(seed, split, index, "lookup", "easy")
  keys = _distinct_keys(rng, split, 1 + distractors, _easy_key)
  store = {k: str(int(rng.integers(10, 100))) for k in keys}
  value = store[keys[0]]
  demo = ((f"<lookup>{keys[0]}</lookup>", True),
          (f"<result>{value}</result>", False),
          (f"<answer>{value}</answer>", True))
  return Task("lookup", f"Q: value of {keys[0]}?\n", value, demo, store)


def make_task(seed: int, split: str, index: int,
              kinds: tuple[str, ...] = KINDS,
              difficulty: str = "standard") -> Task:
  """Task `index` of a split, alternating over `kinds`."""
  if difficulty not in DIFFICULTIES:
    raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got "
                     f"{difficulty!r}")
  kind = kinds[index % len(kinds)]
  easy = difficulty == "easy"
  if kind == "calc":
    return (easy_calc_task if easy else calc_task)(seed, split, index)
  return (easy_lookup_task if easy else lookup_task)(seed, split, index)


# ----------------------------------------------------------------------------
# Parsing model turns and answering them.
# ----------------------------------------------------------------------------

def parse_action(text: str) -> Action:
  """The action of a model turn: its last closing tag and what it encloses.

  Never raises. A turn without a closing tag, or one whose opening tag is
  missing, gives Action("error", message).
  """
  try:
    ends = [(text.rfind(tag), tag) for tag in STOP_TAGS]
    at, tag = max(ends)
    if at < 0:
      return Action("error", "no call")
    name = tag[2:-1]
    opening = f"<{name}>"
    start = text.rfind(opening, 0, at)
    if start < 0:
      return Action("error", f"missing {opening}")
    return Action(name, text[start + len(opening):at].strip())
  except Exception as e:  # pylint: disable=broad-except
    return Action("error", f"unreadable ({type(e).__name__})")


def reward(task: Task, answer: str) -> float:
  """1.0 for an exact (stripped) match of the task's answer, else 0.0."""
  return float(answer.strip() == task.answer)


def observe(task: Task, action: Action) -> str:
  """The tool output appended to the context after a call; never raises."""
  if action.kind == "calc":
    try:
      return f"<result>{evaluate_expression(action.arg)}</result>"
    except CalcError as e:
      return f"<result>error: {e}</result>"
  if action.kind == "lookup":
    if action.arg in task.store:
      return f"<result>{task.store[action.arg]}</result>"
    return "<result>error: no key</result>"
  if action.kind == "error":
    return f"<result>error: {action.arg}</result>"
  return ""  # an answer ends the episode: nothing to observe


def check_demo(task: Task) -> bool:
  """The demonstration replayed through the tools reaches the answer."""
  for (text, own), nxt in zip(task.demo, task.demo[1:] + (("", True),)):
    if not own:
      continue
    action = parse_action(text)
    if action.kind == "answer":
      return reward(task, action.arg) == 1.0
    if observe(task, action) != nxt[0]:
      return False
  return False
