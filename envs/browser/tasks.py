"""Browser tasks, generated from a seed, with their scripted policies.

A task is ``(kind, seed)``: the seed makes the world (``web/sites/world.py``) and picks the
task's subject; the kind says what is asked and how it is scored. ``make_task`` builds any
``(kind, seed)`` (the procedural generator); ``load_tasks`` returns the shipped set, every kind
for each of ``SHIPPED_SEEDS``. Scripted policies (``policy``) are planned on the host by
driving a headless ``TextBrowser`` through the same sites in process, so every ``click`` /
``type`` id is the one the episode's browser shows: ``oracle`` (reward 1), ``wrong`` (a
plausible slip: the neighbouring fact, a missed filter, a forgotten field; reward 0) and
``noop`` (answer at once, reward 0).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jointrl.envs.base import Task, ToolCall
from jointrl.envs.browser.web.sites import base_url, build, in_process_fetch
from jointrl.envs.browser.web.sites.settings import FREQUENCIES, LANGUAGES, TIMEZONES
from jointrl.envs.browser.web.sites.world import CATEGORIES, OCCUPATIONS, World, make_world
from jointrl.envs.browser.web.text_browser import TextBrowser

DOMAIN = "browser"
SHIPPED_SEEDS = (1, 2, 3)
Policy = list[list[ToolCall]]
WIKI, SHOP, SETTINGS = base_url("wiki"), base_url("shop"), base_url("settings")


@dataclass(frozen=True)
class Spec:
    """What a kind's ``make`` returns: the prompt, the reward, its metadata, and the two plans."""

    prompt: str
    reward: dict[str, float]
    metadata: dict[str, Any]
    oracle: Callable[[Planner], None]
    wrong: Callable[[Planner], None]
    max_turns: int = 12


class _Headless(TextBrowser):
    def view(self) -> str:  # the planner needs the element table, not the markdown
        return ""


class Planner:
    """Drives a headless browser over in-process sites and records the tool calls it makes."""

    def __init__(self, seed: int) -> None:
        _, sites, self.state = build(seed)
        self.b = _Headless(in_process_fetch(sites, self.state))
        self.calls: Policy = []

    def _record(self, name: str, **arguments: Any) -> None:
        self.calls.append([ToolCall(name, arguments)])

    def goto(self, url: str) -> None:
        self.b.goto(url)
        self._record("goto", url=url)

    def _find(self, pred: Callable, what: str) -> int:
        assert self.b.page is not None
        for el in self.b.page.elements:
            if pred(el):
                return el.id
        raise LookupError(f"no {what} on {self.b.url}")

    def click_link(self, text: str) -> None:
        i = self._find(lambda el: el.kind == "link" and el.text == text, f"link {text!r}")
        self.b.click(i)
        self._record("click", id=i)

    def click_button(self, text: str) -> None:
        i = self._find(lambda el: el.kind == "submit" and el.text == text, f"button {text!r}")
        self.b.click(i)
        self._record("click", id=i)

    def fill(self, name: str, text: str) -> None:
        i = self._find(lambda el: el.name == name and el.kind in ("text", "select", "textarea"), f"field {name!r}")
        self.b.type(i, text)
        self._record("type", id=i, text=text)

    def check(self, name: str, on: bool) -> None:
        i = self._find(lambda el: el.name == name and el.kind == "checkbox", f"checkbox {name!r}")
        if bool(self.b.values.get(i)) != on:
            self.b.click(i)
            self._record("click", id=i)

    def press(self, key: str) -> None:
        self.b.press(key)
        self._record("press", key=key)

    def search_wiki(self, title: str) -> None:
        self.goto(WIKI + "/")
        self.fill("q", title)
        self.press("Enter")

    def answer(self, text: str) -> None:
        self._record("answer", text=text)


# -- the kinds ------------------------------------------------------------------------------

def _pick(world: World, kind: str, pool: list) -> Any:
    return random.Random(f"{world.seed}/{kind}").choice(sorted(pool))


def _number(value: float, unit: str = "", rel_tol: float = 0.0, abs_tol: float = 0.0) -> dict[str, Any]:
    return {"number": {"value": value, "unit": unit, "rel_tol": rel_tol, "abs_tol": abs_tol}}


def city_population(w: World) -> Spec:
    city = _pick(w, "city_population", list(w.cities))
    other = next(c for c in w.countries[w.cities[city].country].cities if c != city)
    return Spec(f"What is the population of the city of {city}? Use the wiki.", {"answer_number": 1.0},
                _number(w.cities[city].population),
                lambda p: (p.search_wiki(city), p.answer(f"{w.cities[city].population:,}")),
                lambda p: (p.search_wiki(other), p.answer(f"{w.cities[other].population:,}")))


def capital_elevation(w: World) -> Spec:
    country = _pick(w, "capital_elevation", list(w.countries))
    cap = w.countries[country].capital
    other = next(c for c in w.countries[country].cities if c != cap)

    def plan(city: str) -> Callable[[Planner], None]:
        return lambda p: (p.search_wiki(country), p.click_link(city), p.answer(f"{w.cities[city].elevation_m} m"))

    return Spec(f"How high above sea level, in metres, is the capital of {country}?", {"answer_number": 1.0},
                _number(w.cities[cap].elevation_m, "m", abs_tol=0.5), plan(cap), plan(other))


def birth_country(w: World) -> Spec:
    person = _pick(w, "birth_country", list(w.people))
    city = w.people[person].birthplace
    country = w.cities[city].country
    other = next(c for c in sorted(w.countries) if c != country)

    def plan(answer: str) -> Callable[[Planner], None]:
        return lambda p: (p.search_wiki(person), p.click_link(city), p.click_link(country), p.answer(answer))

    return Spec(f"In which country was {person} born?", {"answer_match": 1.0}, {"answer": country},
                plan(country), plan(other))


def mayor_birth_year(w: World) -> Spec:
    city = _pick(w, "mayor_birth_year", list(w.cities))
    mayor = w.cities[city].mayor
    return Spec(f"In what year was the mayor of {city} born?", {"answer_number": 1.0}, _number(w.people[mayor].born),
                lambda p: (p.search_wiki(city), p.click_link(mayor), p.answer(str(w.people[mayor].born))),
                lambda p: (p.search_wiki(city), p.answer(str(w.cities[city].founded))))  # the city's founding year


def longer_river(w: World) -> Spec:
    rng = random.Random(f"{w.seed}/longer_river")
    a, b = rng.sample(sorted(w.rivers), 2)
    longer, shorter = sorted((a, b), key=lambda r: -w.rivers[r].length_km)

    def plan(answer: str) -> Callable[[Planner], None]:
        return lambda p: (p.search_wiki(a), p.search_wiki(b), p.answer(f"The {answer}"))

    return Spec(f"Which river is longer, the {a} or the {b}? Answer with the river's name.", {"answer_match": 1.0},
                {"answer": longer, "aliases": [f"the {longer}", f"{longer} river", f"the {longer} river"]},
                plan(longer), plan(shorter))


def highest_city(w: World) -> Spec:
    country = _pick(w, "highest_city", list(w.countries))
    cities = w.countries[country].cities
    ranked = sorted(cities, key=lambda c: -w.cities[c].elevation_m)

    def plan(answer: str) -> Callable[[Planner], None]:
        def go(p: Planner) -> None:
            p.search_wiki(country)
            for c in cities:
                p.click_link(c)
                p.b.back()
                p._record("back")
            p.answer(answer)
        return go

    return Spec(f"Which city of {country} lies at the highest elevation?", {"answer_match": 1.0},
                {"answer": ranked[0]}, plan(ranked[0]), plan(ranked[1]), max_turns=16)


def source_currency(w: World) -> Spec:
    river = _pick(w, "source_currency", list(w.rivers))
    source = w.rivers[river].source
    country = w.cities[source].country
    other = next(c for c in w.rivers[river].countries if w.countries[c].currency != w.countries[country].currency)

    def plan(c: str) -> Callable[[Planner], None]:
        def go(p: Planner) -> None:
            p.search_wiki(river)
            if c == country:
                p.click_link(source)
            p.click_link(c)
            p.answer(f"the {w.countries[c].currency}")
        return go

    return Spec(f"Which currency is used in the country where the {river} river has its source?",
                {"answer_match": 1.0}, {"answer": w.countries[country].currency,
                                        "aliases": [f"the {w.countries[country].currency}"]}, plan(country), plan(other))


def person_facts(w: World) -> Spec:
    person = _pick(w, "person_facts", list(w.people))
    pp = w.people[person]
    return Spec(f"What is {person}'s occupation, and what is {person} known for? Answer in one sentence.",
                {"answer_includes": 1.0}, {"must_include": [pp.occupation, pp.known_for],
                                           "must_exclude": [o for o in OCCUPATIONS if o != pp.occupation]},
                lambda p: (p.search_wiki(person), p.answer(f"A {pp.occupation}, known for {pp.known_for}.")),
                lambda p: (p.search_wiki(person), p.answer(f"A {pp.occupation} born in {pp.birthplace}.")))


def country_area(w: World) -> Spec:
    country = _pick(w, "country_area", list(w.countries))
    area = w.countries[country].area_km2
    return Spec(f"What is the area of {country}? Give the number with its unit.", {"answer_number": 1.0},
                _number(area, "km²", rel_tol=0.005),
                lambda p: (p.search_wiki(country), p.answer(f"{area:,} km²")),
                lambda p: (p.search_wiki(country), p.answer(f"{area:,} m²")))  # the right digits, the wrong unit


def _cart(sku: str, qty: int = 1) -> dict[str, Any]:
    return {"expected_state": {"cart": {sku: qty}}, "state_match": {"cart": "exact"}}


def _shop_plan(cat: str, product: str, filters: dict[str, str]) -> Callable[[Planner], None]:
    """Open the category, set ``filters`` and "in stock only", apply, add ``product`` to the cart."""
    def go(p: Planner) -> None:
        p.goto(SHOP + "/")
        p.click_link(cat.capitalize())
        for name, value in filters.items():
            p.fill(name, value)
        p.check("in_stock", True)
        p.click_button("Apply filters")
        p.click_link(product)
        p.click_button("Add to cart")
        p.answer("done")
    return go


def cheapest_rated(w: World) -> Spec:
    rng = random.Random(f"{w.seed}/cheapest_rated")
    for cat in rng.sample(sorted(CATEGORIES), len(CATEGORIES)):
        items = sorted((p for p in w.products.values() if p.category == cat and p.stock), key=lambda p: p.price)
        for r in (4.0, 3.5):
            good = [p for p in items if p.rating >= r]
            if good and good[0] is not items[0]:
                break
        else:
            continue
        break
    right, slip = good[0], items[0]
    return Spec(f"In the shop, put one of the cheapest {cat} rated at least {r} (and in stock) in the cart.",
                {"app_state": 1.0}, _cart(right.sku), _shop_plan(cat, right.name, {"min_rating": str(r)}),
                _shop_plan(cat, slip.name, {}))


def buy_quantity(w: World) -> Spec:
    rng = random.Random(f"{w.seed}/buy_quantity")
    product = rng.choice([p for p in sorted(w.products.values(), key=lambda p: p.sku) if p.stock >= 3])
    n = rng.randint(2, min(5, product.stock))

    def plan(qty: int) -> Callable[[Planner], None]:
        def go(p: Planner) -> None:
            p.goto(SHOP + "/")
            p.click_link(product.category.capitalize())
            p.click_link(product.name)
            if qty != 1:
                p.fill("quantity", str(qty))
            p.click_button("Add to cart")
            p.answer("done")
        return go

    return Spec(f"Add {n} units of the {product.name} to the shop cart.", {"app_state": 1.0}, _cart(product.sku, n),
                plan(n), plan(1))


def best_under_price(w: World) -> Spec:
    rng = random.Random(f"{w.seed}/best_under_price")
    for cat in rng.sample(sorted(CATEGORIES), len(CATEGORIES)):
        items = sorted((p for p in w.products.values() if p.category == cat and p.stock), key=lambda p: -p.rating)
        cheap = sorted(p.price for p in items)
        cap = next((int(x) + 1 for x in cheap[1:-1] if (ok := [p for p in items if p.price <= int(x) + 1])
                    and ok[0] is not items[0]), None)
        if cap is not None:
            break
    right = next(p for p in items if p.price <= cap)
    by_rating = {"sort": "Rating: best first"}
    return Spec(f"Put the best-rated {cat[:-1] if cat.endswith('s') else cat} that is in stock and costs at most "
                f"${cap} in the shop cart (one unit).", {"app_state": 1.0}, _cart(right.sku),
                _shop_plan(cat, right.name, {**by_rating, "max_price": str(cap)}), _shop_plan(cat, items[0].name, by_rating))


_NAMES = ["Zoë Ångström", "José Núñez", "Ada Lovelace", "Björn Ødegård", "Chloé Dubois", "Łukasz Żuk"]


def profile_update(w: World) -> Spec:
    rng = random.Random(f"{w.seed}/profile_update")
    name = rng.choice(_NAMES)
    email = f"{name.split()[0].lower().encode('ascii', 'ignore').decode() or 'user'}{rng.randint(1, 99)}@example.org"
    tz = rng.choice([t for t in TIMEZONES if t != "UTC+00:00"])
    lang = rng.choice(LANGUAGES[1:])
    want = {"display_name": name, "email": email, "timezone": tz, "language": lang}

    def plan(fields: dict[str, str]) -> Callable[[Planner], None]:
        def go(p: Planner) -> None:
            p.goto(SETTINGS + "/profile")
            for k, v in fields.items():
                p.fill(k, v)
            p.click_button("Save")
            p.answer("done")
        return go

    return Spec(f"In the settings app, set your display name to {name}, your email to {email}, your time zone "
                f"to {tz} and your language to {lang}, and save.", {"app_state": 1.0},
                {"expected_state": {"profile": want}},
                plan(want), plan({k: v for k, v in want.items() if k != "language"}))


def address_from_wiki(w: World) -> Spec:
    rng = random.Random(f"{w.seed}/address_from_wiki")
    country = rng.choice(sorted(w.countries)[1:])  # never the form's default
    capital = w.countries[country].capital
    street = f"{rng.randint(1, 200)} {rng.choice(['Harbour', 'Mill', 'Station', 'Orchard'])} Road"
    postcode = f"{rng.randint(10000, 99999)}"
    want = {"street": street, "city": capital, "postcode": postcode, "country": country}
    other = next(c for c in w.countries[country].cities if c != capital)
    slip = {**want, "country": next(c for c in sorted(w.countries) if c != country)}

    def plan(fields: dict[str, str]) -> Callable[[Planner], None]:
        def go(p: Planner) -> None:
            p.search_wiki(capital)
            p.click_link(country)
            p.goto(SETTINGS + "/address")
            for k, v in fields.items():
                p.fill(k, v)
            p.click_button("Save")
            p.answer("done")
        return go

    del other
    return Spec(f"Set your shipping address in the settings app: {street}, postcode {postcode}, in the city of "
                f"{capital}, and as country the country whose capital {capital} is (look it up in the wiki).",
                {"app_state": 1.0}, {"expected_state": {"address": want}}, plan(want), plan(slip), max_turns=16)


def notifications(w: World) -> Spec:
    rng = random.Random(f"{w.seed}/notifications")
    digest = rng.choice([f for f in FREQUENCIES if f != "weekly"])
    want = {"email_alerts": False, "sms_alerts": True, "digest": digest}

    def plan(email_off: bool) -> Callable[[Planner], None]:
        def go(p: Planner) -> None:
            p.goto(SETTINGS + "/")
            p.click_link("Notifications")
            p.check("email_alerts", not email_off)
            p.check("sms_alerts", True)
            p.fill("digest", digest)
            p.click_button("Save")
            p.answer("done")
        return go

    return Spec(f"In the settings app, turn email alerts off, turn SMS alerts on, and set the digest frequency "
                f"to {digest}.", {"app_state": 1.0}, {"expected_state": {"notifications": want}},
                plan(True), plan(False))


KINDS: dict[str, Callable[[World], Spec]] = {f.__name__: f for f in (
    city_population, capital_elevation, birth_country, mayor_birth_year, longer_river, highest_city,
    source_currency, person_facts, country_area, cheapest_rated, buy_quantity, best_under_price,
    profile_update, address_from_wiki, notifications)}


# -- tasks and policies ---------------------------------------------------------------------

def make_task(kind: str, seed: int) -> Task:
    """The task of ``kind`` in the world of ``seed`` (any int: the procedural generator)."""
    if kind not in KINDS:
        raise ValueError(f"unknown browser task kind {kind!r}; available: {sorted(KINDS)}")
    spec = KINDS[kind](make_world(seed))
    return Task(id=f"{kind}-{seed}", domain=DOMAIN, prompt=spec.prompt, max_turns=spec.max_turns, reward=spec.reward,
                metadata={"kind": kind, "seed": seed, **spec.metadata})


def load_tasks(seeds: tuple[int, ...] = SHIPPED_SEEDS) -> list[Task]:
    """Every kind for each seed, sorted by id."""
    return sorted((make_task(k, s) for s in seeds for k in KINDS), key=lambda t: t.id)


POLICIES = ("oracle", "wrong", "noop")


def policy(task: Task, name: str) -> Policy:
    """The task's named scripted policy, as turns of tool calls."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {list(POLICIES)}")
    if name == "noop":
        return [[ToolCall("answer", {"text": ""})]]
    seed = task.metadata["seed"]
    spec = KINDS[task.metadata["kind"]](make_world(seed))
    planner = Planner(seed)
    (spec.oracle if name == "oracle" else spec.wrong)(planner)
    return planner.calls
