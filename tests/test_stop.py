"""Stop-string handling for streamed text."""

from __future__ import annotations

import random

import pytest

from heron.core.stop import StopChecker


def run(checker: StopChecker, pieces: list[str]) -> tuple[list[str], str | None]:
    """Feed pieces until a stop matches; return the emitted chunks (flush last) and the stop."""
    out = []
    for piece in pieces:
        text, matched = checker.feed(piece)
        out.append(text)
        if matched is not None:
            return out, matched
    out.append(checker.flush())
    return out, checker.matched  # flush may still resolve a match at the very end


def test_cut_exactly_before_stop():
    out, matched = run(StopChecker(["STOP"]), ["hello STOP world"])
    assert out == ["hello "] and matched == "STOP"


def test_stop_spanning_feeds_is_held_back():
    checker = StopChecker(["</answer>"])
    assert checker.feed("The answer is 4</") == ("The answer is 4", None)
    assert checker.held == "</"
    assert checker.feed("ans") == ("", None)
    assert checker.feed("wer> trailing") == ("", "</answer>")
    assert checker.is_stopped
    with pytest.raises(RuntimeError):
        checker.feed("more")


def test_include_stop_str_in_output():
    out, matched = run(StopChecker(["\n\n"], include_stop_str_in_output=True), ["a\n", "\nb"])
    assert "".join(out) == "a\n\n" and matched == "\n\n"


def test_false_alarm_is_released():
    out, matched = run(StopChecker(["abc"]), ["xa", "b", "d", "ab"])
    assert out == ["x", "", "abd", "", "ab"] and matched is None  # "ab" held, then flushed


def test_earliest_stop_wins():
    out, matched = run(StopChecker(["world", "lo"]), ["hello world"])
    assert out == ["hel"] and matched == "lo"
    out, matched = run(StopChecker(["b", "ab"]), ["xab"])
    assert out == ["x"] and matched == "ab"


def test_longer_stop_starting_earlier_is_waited_for():
    # "c" is complete, but "abcd" starts earlier and might still match: wait for the text.
    checker = StopChecker(["c", "abcd"])
    assert checker.feed("xabc") == ("x", None)
    assert checker.feed("d") == ("", "abcd")
    checker = StopChecker(["c", "abcd"])
    checker.feed("xabc")
    assert checker.feed("e") == ("ab", "c")


def test_flush_resolves_a_waiting_match():
    checker = StopChecker(["b", "abc"])
    assert checker.feed("xab") == ("x", None)  # "b" is complete, but "abc" might follow
    assert checker.flush() == "a" and checker.matched == "b"


def test_hold_back_is_bounded():
    checker = StopChecker(["abcdef", "xy"])
    for _ in range(20):
        checker.feed("abcde")  # never completes: "abcdeabcde..." only prefixes at the tail
        assert len(checker.held) <= len("abcdef") - 1


def test_no_stops_and_empty_stops_pass_through():
    checker = StopChecker(["", ""])
    assert checker.feed("anything") == ("anything", None)
    assert checker.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_agree_with_one_shot(seed):
    """However the text is split into feeds, the output is the one-shot answer."""
    rng = random.Random(seed)
    alphabet = "ab\n<>/"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)]
    include = rng.random() < 0.5
    whole, whole_match = run(StopChecker(stops, include), [text])
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    split, split_match = run(StopChecker(stops, include), pieces)
    assert "".join(split) == "".join(whole) and split_match == whole_match
    # reference: the earliest start, ties by list order
    found = [(text.find(s), k, s) for k, s in enumerate(stops) if s in text]
    if found:
        start, _, stop = min(found)
        assert whole_match == stop
        assert "".join(whole) == text[: start + (len(stop) if include else 0)]
    else:
        assert "".join(whole) == text
