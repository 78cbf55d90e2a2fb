"""The answer rewards and the app-state reward on hand-made answers; their doctests run here."""

import doctest
import json

import pytest

from jointrl.envs.base import EnvError, Task
from jointrl.rewards import answer_match, app_state
from jointrl.rewards.base import Episode, get


@pytest.mark.parametrize("module", [answer_match, app_state])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted >= 2 and result.failed == 0


def score(name, final_answer, **metadata):
    task = Task(id="t", domain="browser", prompt="?", reward={name: 1.0}, metadata=metadata)
    return get(name)(task, Episode(messages=[], final_answer=final_answer)).score


@pytest.mark.parametrize("answer, expected, aliases, ok", [
    ("Voraeth", "Voraeth", [], True),
    ("voraeth.", "Voraeth", [], True),
    ("  VORAETH!! ", "Voraeth", [], True),
    ("The Tekebra", "Tekebra", [], True),
    ("Tekebra River", "Tekebra", ["Tekebra river"], True),
    ("São Paulo", "Sao Paulo", [], True),
    ("Zoë Ångström", "zoe angstrom", [], True),
    ("日本語", "日本語", [], True),
    ("日本", "日本語", [], False),
    ("Voraeth or Rakri", "Voraeth", [], False),
    ("Rakri", "Voraeth", [], False),
    ("", "Voraeth", [], False),
    ("?!", "", [], False),  # nothing left after normalization never matches
    (None, "Voraeth", [], False),
])
def test_answer_match(answer, expected, aliases, ok):
    assert score("answer_match", answer, answer=expected, aliases=aliases) == float(ok)


@pytest.mark.parametrize("answer, ok", [
    ("A botanist, known for the Storiam Bridge.", True),
    ("known for THE STORIAM-BRIDGE; a Botanist", True),
    ("A botanist born in Giapou.", False),
    ("A botanists' society, known for the Storiam Bridges", False),  # whole words only
    ("", False),
    ("A botanist, painter or poet, known for the Storiam Bridge.", False),  # listing the candidates
])
def test_answer_includes(answer, ok):
    assert score("answer_includes", answer, must_include=["botanist", "the Storiam Bridge"],
                 must_exclude=["painter", "poet"]) == float(ok)


@pytest.mark.parametrize("answer, value, unit, rel_tol, abs_tol, ok", [
    ("1,733 m", 1733, "m", 0, 0.5, True),
    ("about 1733 metres above sea level", 1733, "m", 0, 0.5, True),
    ("1.733 km", 1733, "m", 0, 0.5, True),
    ("1733", 1733, "m", 0, 0.5, True),  # a bare number is read in the expected unit
    ("1733 ft", 1733, "m", 0, 0.5, False),
    ("1734 m", 1733, "m", 0, 0.5, False),
    ("746,380 km²", 746380, "km²", 0.005, 0, True),
    ("746 380 sq km", 746380, "km²", 0.005, 0, True),
    ("about 0.75 million km2", 746380, "km²", 0.005, 0, True),
    ("746,380 m²", 746380, "km²", 0.005, 0, False),
    ("746,380 km", 746380, "km²", 0.005, 0, False),  # length is not area
    ("2,763,000", 2763000, "", 0, 0, True),
    ("2.763 million people", 2763000, "", 0, 0, True),
    ("2763000 km", 2763000, "", 0, 0, False),  # a unit where a count was asked
    ("$24.00", 24, "$", 0, 0.005, True),
    ("It was 1833.", 1833, "", 0, 0, True),
    ("1833 or 1834", 1833, "", 0, 0, False),  # a hedge
    ("born in 1833, mayor since 1870", 1833, "", 0, 0, False),  # one number, please
    ("−5 m", -5, "m", 0, 0, True),  # a unicode minus
    ("no idea", 1833, "", 0, 0, False),
    ("", 1833, "", 0, 0, False),
])
def test_answer_number(answer, value, unit, rel_tol, abs_tol, ok):
    spec = {"value": value, "unit": unit, "rel_tol": rel_tol, "abs_tol": abs_tol}
    assert score("answer_number", answer, number=spec) == float(ok)


def test_answer_rewards_name_a_missing_key():
    with pytest.raises(ValueError, match="metadata\\['number'\\]"):
        score("answer_number", "12")


class _StateSandbox:
    """Stands in for the verification sandbox's file read: a reward input, not the component under test."""

    def __init__(self, state):
        self.state, self.closed = state, False

    def read_file(self, path):
        assert path == app_state.STATE_FILE
        if self.state is None:
            raise FileNotFoundError(path)
        return json.dumps(self.state).encode()

    def close(self):
        self.closed = True


@pytest.mark.parametrize("state, ok", [
    ({"cart": {"KE-104": 2}, "profile": {"display_name": "Zoë", "email": "z@x.org"}}, True),
    ({"cart": {"KE-104": 2, "LA-100": 1}, "profile": {"display_name": "Zoë"}}, False),  # cart is exact
    ({"cart": {"KE-104": 1}, "profile": {"display_name": "Zoë"}}, False),
    ({"cart": {"KE-104": 2}, "profile": {"display_name": "Zoe"}}, False),  # stored values match exactly
    ({"cart": {"KE-104": 2}}, False),
])
def test_app_state(state, ok):
    task = Task(id="t", domain="browser", prompt="?", reward={"app_state": 1.0},
                metadata={"expected_state": {"cart": {"KE-104": 2}, "profile": {"display_name": "Zoë"}},
                          "state_match": {"cart": "exact"}})
    sandbox = _StateSandbox(state)
    result = get("app_state")(task, Episode(messages=[], verify_sandbox=lambda: sandbox))
    assert result.score == float(ok) and sandbox.closed


def test_app_state_without_a_state_file_is_an_infrastructure_failure():
    task = Task(id="t", domain="browser", prompt="?", metadata={"expected_state": {"cart": {}}})
    with pytest.raises(EnvError, match="cannot read"):
        get("app_state")(task, Episode(messages=[], verify_sandbox=lambda: _StateSandbox(None)))
