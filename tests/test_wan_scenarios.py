"""Wide-area scenarios: the shipped file, any number of sites, and every wrong key or value
refused with the file, the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossipd.bench.wan_scenarios import DEFAULT_PATH, SiteLink, load_scenarios, scenario
from gossipd.node.errors import ConfigError

FAST, SLOW = SiteLink(1000, 5), SiteLink(100, 50)


def test_the_shipped_scenarios_give_every_site_its_link_for_any_number_of_sites() -> None:
    scenarios = load_scenarios()
    assert {"uniform-100mbit-5ms", "uniform-100mbit-50ms", "two-fast-six-slow"} <= set(scenarios)
    assert scenarios["uniform-100mbit-5ms"].links(3) == [SiteLink(100, 5)] * 3
    assert scenarios["uniform-100mbit-50ms"].links(8) == [SLOW] * 8
    mixed = scenarios["two-fast-six-slow"]
    assert mixed.links(8) == [FAST, FAST] + [SLOW] * 6
    assert mixed.links(3) == [FAST, FAST, SLOW]
    assert mixed.links(1) == [FAST]
    assert mixed.links(10) == [FAST, FAST] + [SLOW] * 8
    assert mixed.description and scenario("two-fast-six-slow") == mixed


def test_an_override_changes_only_what_it_gives(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        "[edge]\nrate_mbit = 50\nlatency_ms = 20\n"
        "[[edge.override]]\nsites = [2]\nlatency_ms = 80\n"
        "[[edge.override]]\nsites = [0, 5]\nrate_mbit = 1000\n"
    )
    (edge,) = load_scenarios(path).values()
    assert edge.links(3) == [SiteLink(1000, 20), SiteLink(50, 20), SiteLink(50, 80)]
    assert edge.description == ""


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[a]\nrate_mbit = 100\nlatency_ms = \n", ["not valid TOML", "fix the syntax"]),
        ("", ["holds no scenario", "add a table"]),
        ("a = 1\n", ["'a' must be a table", "rate_mbit and latency_ms"]),
        ("[a]\nlatency_ms = 5\n", ["[a] has no rate_mbit", "add rate_mbit = <number>"]),
        ("[a]\nrate_mbit = 100\n", ["[a] has no latency_ms", "add latency_ms"]),
        ("[a]\nrate_mbit = 0\nlatency_ms = 5\n", ["[a] rate_mbit", "above 0", "got 0"]),
        ("[a]\nrate_mbit = -10\nlatency_ms = 5\n", ["[a] rate_mbit", "got -10"]),
        ("[a]\nrate_mbit = 1e7\nlatency_ms = 5\n", ["[a] rate_mbit", "at most 1000000"]),
        ("[a]\nrate_mbit = '100'\nlatency_ms = 5\n", ["[a] rate_mbit", "got '100'"]),
        ("[a]\nrate_mbit = true\nlatency_ms = 5\n", ["[a] rate_mbit", "got True"]),
        ("[a]\nrate_mbit = nan\nlatency_ms = 5\n", ["[a] rate_mbit", "got nan"]),
        ("[a]\nrate_mbit = 100\nlatency_ms = -1\n", ["[a] latency_ms", "0 or more", "got -1"]),
        ("[a]\nrate_mbit = 100\nlatency_ms = inf\n", ["[a] latency_ms", "got inf"]),
        ("[a]\nrate_mbit = 100\nlatency_ms = 5\nrate = 3\n", ["unknown key 'rate'", "rate_mbit"]),
        ("[a]\nrate_mbit = 100\nlatency_ms = 5\ndescription = 3\n", ["description", "string"]),
        ("[a]\nrate_mbit = 100\nlatency_ms = 5\noverride = 3\n", ["[[a.override]]", "got 3"]),
        (
            "[a]\nrate_mbit = 1\nlatency_ms = 5\n[[a.override]]\nsites = []\nrate_mbit = 2\n",
            ["override]] #1 sites", "non-empty", "sites = [0, 1]"],
        ),
        (
            "[a]\nrate_mbit = 1\nlatency_ms = 5\n[[a.override]]\nsites = [-1]\nrate_mbit = 2\n",
            ["sites must be", "got [-1]"],
        ),
        (
            "[a]\nrate_mbit = 1\nlatency_ms = 5\n[[a.override]]\nsites = 0\nrate_mbit = 2\n",
            ["sites must be", "got 0"],
        ),
        (
            "[a]\nrate_mbit = 1\nlatency_ms = 5\n[[a.override]]\nsites = [0]\n",
            ["override]] #1 changes nothing", "rate_mbit and/or latency_ms"],
        ),
        (
            "[a]\nrate_mbit = 1\nlatency_ms = 5\n[[a.override]]\nsites = [0]\nlatency = 9\n",
            ["override]] #1 has an unknown key 'latency'", "latency_ms"],
        ),
        (
            "[a]\nrate_mbit = 1\nlatency_ms = 5\n[[a.override]]\nsites = [0]\nrate_mbit = 0\n",
            ["override]] #1 rate_mbit", "got 0"],
        ),
        (
            "[a]\nrate_mbit = 1\nlatency_ms = 5\n"
            "[[a.override]]\nsites = [0, 1]\nrate_mbit = 2\n"
            "[[a.override]]\nsites = [1]\nrate_mbit = 3\n",
            ["overrides site 1 twice", "one [[a.override]] only"],
        ),
    ],
)
def test_a_wrong_scenario_file_is_refused_naming_the_file_the_key_and_the_fix(
    tmp_path: Path, text: str, names: list[str]
) -> None:
    path = tmp_path / "scenarios.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_scenarios(path)
    assert str(path) in str(err.value)
    for name in names:
        assert name in str(err.value)


def test_a_missing_file_and_an_unknown_name_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the scenario file .*nowhere\.toml"):
        load_scenarios(tmp_path / "nowhere.toml")
    with pytest.raises(ConfigError) as err:
        scenario("transatlantic")
    assert str(DEFAULT_PATH) in str(err.value)
    assert "'transatlantic'" in str(err.value) and "two-fast-six-slow" in str(err.value)
    assert "add a [transatlantic] table" in str(err.value)


def test_links_and_site_links_refuse_impossible_values() -> None:
    mixed = scenario("two-fast-six-slow")
    for n_sites in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="number of sites must be an integer"):
            mixed.links(n_sites)  # type: ignore[arg-type]
    # tc itself would take a negative rate as a link that sends nothing.
    with pytest.raises(ConfigError, match=r"rate_mbit must be .* got -1"):
        SiteLink(-1, 5)
    with pytest.raises(ConfigError, match=r"latency_ms must be .* got nan"):
        SiteLink(100, float("nan"))
