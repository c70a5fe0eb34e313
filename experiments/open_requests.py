"""Open-ended chat requests (letters, stories, explanations, poems, advice, descriptions) from templates and
word lists, for `chat_prompts.py --open`: prompts a drafter trained on reasoning-gym questions has not seen."""

from __future__ import annotations

import itertools
import random

PEOPLE = ("my grandmother", "a new neighbour", "my manager", "an old school friend", "the city council",
          "a pen pal in Japan", "my landlord", "a local bakery", "my younger brother", "a retiring teacher")
PURPOSES = ("to thank them for their help last month", "to invite them to a summer picnic",
            "to apologise for missing their party", "to ask for advice about changing careers",
            "to share news about a move to another city", "to complain politely about street noise")
CHARACTERS = ("a lighthouse keeper", "a curious robot", "a shy dragon", "a pair of rival chefs", "a lost cat",
              "a young astronaut", "an old fisherman", "a librarian", "a talking tree", "a street musician")
EVENTS = ("finds a mysterious map", "has to cross a frozen river", "loses something precious",
          "meets a stranger on a train", "wakes up in a different century", "must win a village contest")
CONCEPTS = ("photosynthesis", "how vaccines work", "inflation", "why the sky is blue", "compound interest",
            "how a rainbow forms", "the water cycle", "what a black hole is", "how bridges stay up",
            "why we have seasons", "how the internet sends a message", "what DNA does")
AUDIENCES = ("a ten-year-old", "a busy adult", "a curious grandparent", "a high-school student")
THINGS = ("the ocean at night", "autumn leaves", "a quiet library", "the first snow", "a city at dawn",
          "an old bicycle", "a thunderstorm", "a cup of morning coffee")
GOALS = ("learn to cook", "start running", "read more books", "save money", "learn a new language",
         "sleep better", "make new friends in a new city", "become a better public speaker")
# A template and its word lists: every combination is one request.
TEMPLATES = (
    ("Write a short letter to {} {}.", PEOPLE, PURPOSES),
    ("Tell a short story about {} who {}.", CHARACTERS, EVENTS),
    ("Explain {} to {}.", CONCEPTS, AUDIENCES),
    ("Write a short poem about {} for {}.", THINGS, PEOPLE),
    ("Give {} practical advice on how to {}.", AUDIENCES, GOALS),
    ("Describe {} in a few sentences, as if to {}.", THINGS, AUDIENCES),
)


def open_requests(size: int, seed: int) -> list[str]:
  """`size` requests in seed `seed`'s order: seed 0 from 7/8 of every combination, any other seed from the
  other 1/8, split in one fixed order (so held-out seeds share none of seed 0's)."""
  every = [template.format(*words) for template, *lists in TEMPLATES for words in itertools.product(*lists)]
  every = random.Random(0).sample(every, len(every))
  split = len(every) * 7 // 8
  pool = every[:split] if seed == 0 else every[split:]
  if size > len(pool):
    raise ValueError(f"--size={size}: --seed={seed} draws from {len(pool)} open requests")
  return random.Random(seed).sample(pool, size)
