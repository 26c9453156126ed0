"""Stop strings: speculative steps of any length stop where plain decoding does; a bare str is one stop string."""

from __future__ import annotations

import pytest
import torch

from dropmatch.drafters.base import Draft
from dropmatch.engine import generate
from dropmatch.errors import ConfigError
from dropmatch.models import ByteTokenizer
from dropmatch.stopping import StopOnText

TOKENIZER = ByteTokenizer()


def _ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class _Oracle:
    """Proposes the target's own greedy continuation ``sequence``: every draft token is accepted."""

    name = "oracle"

    def __init__(self, sequence: list[int]):
        self.sequence = sequence

    def start(self, prompt_ids, features=None) -> None:
        self.position = 0

    def propose(self, last_token: int, n: int, sampling, generator) -> Draft:
        self.position += 1  # last_token is sequence[position - 1]
        return Draft(torch.tensor(self.sequence[self.position : self.position + n], dtype=torch.long))

    def commit(self, n_accepted: int, features=None) -> None:
        self.position += n_accepted


@pytest.mark.parametrize("draft_len", [5, 60])
def test_a_step_longer_than_the_window_stops_where_plain_decoding_does(tiny, draft_len):
    """A stop string early in a step of 60 accepted tokens (more than the 48-token window) still stops it."""
    prompt = torch.tensor(tiny.encode("Hello world"))
    free = generate(tiny.target, prompt, max_new_tokens=100).token_ids
    first = next(i for i, t in enumerate(free) if i >= 5 and 3 <= t < 3 + 128)  # an ASCII byte, one character
    stop = chr(free[first] - 3)
    plain = generate(tiny.target, prompt, max_new_tokens=100, should_stop=StopOnText(tiny.decode, stop)).token_ids
    assert plain == free[: free.index(free[first]) + 1] and len(plain) < 40
    result = generate(tiny.target, prompt, drafter=_Oracle(free), draft_len=draft_len, max_new_tokens=100,
                      should_stop=StopOnText(tiny.decode, stop))
    assert result.token_ids == plain
    assert result.stats.accepted_per_step[0] == min(draft_len, len(plain) - 1)  # at 60: all of it in one step


def test_the_first_stop_among_many_new_tokens_and_a_new_output_is_checked_from_its_start():
    stop = StopOnText(TOKENIZER.decode, ["##", "\n\n"], window=4)
    assert stop(_ids("abc")) is None
    text = "abc" + "x" * 20 + "#" + "y" * 20 + "##z\n\n"
    assert stop(_ids(text)) == text.index("##") + 2
    assert stop(_ids("\n\nabc")) == 2  # not an extension of the last output: checked from its first token


def test_a_bare_string_is_one_stop_string_and_the_window_must_hold_a_token():
    ids = _ids("Question: 1\n2")
    assert StopOnText(TOKENIZER.decode, "Answer")(ids) is None  # not 'A', 'n', 's', ...
    assert StopOnText(TOKENIZER.decode, "\n2")(ids) == len(ids)
    with pytest.raises(ConfigError, match="window"):
        StopOnText(TOKENIZER.decode, ["Q"], window=0)
