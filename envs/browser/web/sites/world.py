"""The fictional world behind the sites, generated deterministically from a seed.

Countries, cities, people and rivers for the wiki (every fact a task asks about lives in an
infobox table, reached through links); products for the shop. Names are built from syllables,
so no task can be answered from memory of the real world. Same seed, same world, on the host
(task generation) and in the sandbox (the served sites).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_ONSETS = ["b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
_CODAS = ["", "n", "r", "s", "l", "th", "m", "nd", "x"]
CONTINENTS = ["Northreach", "Sundara", "Meridia"]
CURRENCIES = ["crown", "mark", "florin", "talen", "ducat", "real", "sol", "dinar"]
OCCUPATIONS = ["painter", "engineer", "poet", "astronomer", "composer", "architect", "botanist", "cartographer"]
CATEGORIES = {  # shop category -> (noun, spec name, spec unit)
    "kettles": ("Kettle", "capacity", "L"),
    "lamps": ("Lamp", "brightness", "lm"),
    "backpacks": ("Backpack", "volume", "L"),
    "headphones": ("Headphones", "battery life", "h"),
}
_BRANDS = ["Aldor", "Brightwell", "Corvan", "Dunmore", "Elstree", "Fenwick"]


@dataclass
class Country:
    name: str
    capital: str = ""
    cities: list[str] = field(default_factory=list)
    population: int = 0
    area_km2: int = 0
    currency: str = ""
    founded: int = 0
    continent: str = ""


@dataclass
class City:
    name: str
    country: str
    population: int
    elevation_m: int
    founded: int
    mayor: str = ""
    river: str = ""


@dataclass
class Person:
    name: str
    born: int
    birthplace: str
    occupation: str
    known_for: str


@dataclass
class River:
    name: str
    length_km: int
    source: str  # a city
    countries: list[str] = field(default_factory=list)


@dataclass
class Product:
    sku: str
    name: str
    category: str
    brand: str
    price: float
    rating: float
    stock: int
    spec: float


@dataclass
class World:
    seed: int
    countries: dict[str, Country]
    cities: dict[str, City]
    people: dict[str, Person]
    rivers: dict[str, River]
    products: dict[str, Product]

    def kind_of(self, title: str) -> str:
        for kind in ("countries", "cities", "people", "rivers"):
            if title in getattr(self, kind):
                return kind
        raise KeyError(title)


def _name(rng: random.Random, used: set[str], syllables: tuple[int, int] = (2, 3)) -> str:
    while True:
        n = rng.randint(*syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)) + rng.choice(_CODAS)
        word = word.capitalize()
        if word not in used and len(word) >= 4:
            used.add(word)
            return word


def make_world(seed: int, n_countries: int = 8, cities_per_country: int = 3, n_people: int = 16,
               n_rivers: int = 6, products_per_category: int = 6) -> World:
    """The world of ``seed``. Numbers are distinct where tasks compare them (no ties)."""
    rng = random.Random(seed)
    used: set[str] = set()
    countries: dict[str, Country] = {}
    cities: dict[str, City] = {}
    pops = rng.sample(range(20_000, 3_000_000, 1_000), n_countries * cities_per_country)
    elevations = rng.sample(range(5, 2_400), n_countries * cities_per_country)
    currencies = rng.sample(CURRENCIES, len(CURRENCIES))
    for i in range(n_countries):
        c = Country(_name(rng, used), population=0, area_km2=rng.randrange(8_000, 900_000, 10),
                    currency=currencies[i % len(currencies)], founded=rng.randint(800, 1900),
                    continent=CONTINENTS[i % len(CONTINENTS)])
        for j in range(cities_per_country):
            k = i * cities_per_country + j
            city = City(_name(rng, used), c.name, pops[k], elevations[k], rng.randint(c.founded - 600, c.founded + 90))
            cities[city.name] = city
            c.cities.append(city.name)
        c.capital = max(c.cities, key=lambda n: cities[n].population)  # the largest city is the capital
        c.population = sum(cities[n].population for n in c.cities) + rng.randrange(100_000, 2_000_000, 1_000)
        countries[c.name] = c
    people: dict[str, Person] = {}
    city_names = list(cities)
    births = rng.sample(range(1600, 1990), n_people)
    for i in range(n_people):
        name = f"{_name(rng, used, (1, 2))} {_name(rng, used)}"
        occ = OCCUPATIONS[i % len(OCCUPATIONS)]
        work = f"the {_name(rng, used, (2, 2))} {rng.choice(['Cycle', 'Bridge', 'Atlas', 'Theorem', 'Garden', 'Tower'])}"
        people[name] = Person(name, births[i], rng.choice(city_names), occ, work)
    for i, name in enumerate(city_names):  # every city gets a mayor, some mayors run two
        cities[name].mayor = list(people)[i % n_people]
    rivers: dict[str, River] = {}
    lengths = rng.sample(range(80, 4_000), n_rivers)
    for i in range(n_rivers):
        r = River(_name(rng, used), lengths[i], rng.choice(city_names))
        through = [cities[r.source].country] + rng.sample([c for c in countries if c != cities[r.source].country], 2)
        r.countries = through
        rivers[r.name] = r
        for cname in countries[cities[r.source].country].cities:
            if not cities[cname].river:
                cities[cname].river = r.name
                break
    products: dict[str, Product] = {}
    for cat, (noun, _, unit) in CATEGORIES.items():
        prices = rng.sample(range(1_500, 25_000, 25), products_per_category)
        ratings = rng.sample([x / 10 for x in range(28, 50)], products_per_category)
        for j in range(products_per_category):
            sku = f"{cat[:2].upper()}-{100 + j}"
            brand = _BRANDS[(j + len(products)) % len(_BRANDS)]
            spec = round(rng.uniform(0.8, 3.0), 1) if unit == "L" and cat == "kettles" else rng.randrange(10, 90)
            products[sku] = Product(sku, f"{brand} {_name(rng, used, (1, 2))} {noun}", cat, brand, prices[j] / 100,
                                    ratings[j], rng.randint(0, 40), spec)
    return World(seed, countries, cities, people, rivers, products)
