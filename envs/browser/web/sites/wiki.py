"""The encyclopedia: articles with infobox tables and cross-links, categories, and search."""

from __future__ import annotations

import urllib.parse

from .app import Request, Response, State, e, link, not_found, page, table
from .world import World

KINDS = {"countries": "Countries", "cities": "Cities", "people": "People", "rivers": "Rivers"}
NAV = [("/", "Wiki home"), ("/category/countries", "Countries"), ("/category/cities", "Cities"),
       ("/category/people", "People"), ("/category/rivers", "Rivers")]


def href(title: str) -> str:
    return "/wiki/" + urllib.parse.quote(title.replace(" ", "_"))


def a(title: str) -> str:
    return link(href(title), title)


def num(n: float) -> str:
    return f"{n:,}"


class Wiki:
    def __init__(self, world: World) -> None:
        self.w = world

    def __call__(self, req: Request, state: State) -> Response:
        path = req.path.rstrip("/") or "/"
        if path == "/":
            return self.home()
        if path == "/search":
            return self.search(req.param("q"))
        if path.startswith("/category/") and path[10:] in KINDS:
            kind = path[10:]
            items = "".join(f"<li>{a(t)}</li>" for t in sorted(getattr(self.w, kind)))
            return Response(200, page(f"Category: {KINDS[kind]}", f"<ul>{items}</ul>", NAV))
        if path.startswith("/wiki/"):
            title = path[6:].replace("_", " ")
            body = self.article(title)
            return Response(200, page(title, body, NAV)) if body else not_found(path)
        return not_found(path)

    def home(self) -> Response:
        form = ("<form action='/search' method='get'><input type='text' name='q' placeholder='Search the wiki'>"
                "<button type='submit'>Search</button></form>")
        cats = "".join(f"<li>{link('/category/' + k, v)}</li>" for k, v in KINDS.items())
        return Response(200, page("Wiki", f"{form}<p>Browse by category:</p><ul>{cats}</ul>", NAV))

    def search(self, q: str) -> Response:
        q = q.strip()
        titles = [t for kind in KINDS for t in getattr(self.w, kind)]
        exact = [t for t in titles if t.casefold() == q.casefold()]
        if exact:
            return Response.redirect(href(exact[0]))
        hits = sorted(t for t in titles if q and q.casefold() in t.casefold())
        items = "".join(f"<li>{a(t)}</li>" for t in hits) or "<li>No results.</li>"
        return Response(200, page(f"Search results for '{q}'", f"<ul>{items}</ul>", NAV))

    def article(self, title: str) -> str:
        w = self.w
        if title in w.countries:
            c = w.countries[title]
            others = ", ".join(a(x) for x in c.cities if x != c.capital)
            rivers = [r.name for r in w.rivers.values() if title in r.countries]
            box = table([("Capital", a(c.capital)), ("Continent", e(c.continent)), ("Population", num(c.population)),
                         ("Area", f"{num(c.area_km2)} km²"), ("Currency", e(c.currency)), ("Founded", str(c.founded))])
            prose = (f"<p>{e(title)} is a country in {e(c.continent)}. Its capital and largest city is {a(c.capital)}; "
                     f"other cities include {others}.</p>")
            if rivers:
                prose += f"<p>Rivers flowing through {e(title)}: {', '.join(a(r) for r in rivers)}.</p>"
            return box + prose
        if title in w.cities:
            c = w.cities[title]
            box = table([("Country", a(c.country)), ("Population", num(c.population)),
                         ("Elevation", f"{num(c.elevation_m)} m"), ("Founded", str(c.founded)),
                         ("Mayor", a(c.mayor)), ("River", a(c.river) if c.river else "none")])
            born = [p.name for p in w.people.values() if p.birthplace == title]
            prose = f"<p>{e(title)} is a city in {a(c.country)}, led by mayor {a(c.mayor)}.</p>"
            if born:
                prose += f"<p>Notable people born here: {', '.join(a(p) for p in born)}.</p>"
            return box + prose
        if title in w.people:
            p = w.people[title]
            box = table([("Born", str(p.born)), ("Birthplace", a(p.birthplace)), ("Occupation", e(p.occupation)),
                         ("Known for", e(p.known_for))])
            mayor_of = [c.name for c in w.cities.values() if c.mayor == title]
            prose = f"<p>{e(title)} (born {p.born} in {a(p.birthplace)}) is a {e(p.occupation)}, known for {e(p.known_for)}.</p>"
            if mayor_of:
                prose += f"<p>{e(title)} is the mayor of {', '.join(a(c) for c in mayor_of)}.</p>"
            return box + prose
        if title in w.rivers:
            r = w.rivers[title]
            box = table([("Length", f"{num(r.length_km)} km"), ("Source", a(r.source)),
                         ("Countries", ", ".join(a(c) for c in r.countries))])
            return box + f"<p>The {e(title)} rises near {a(r.source)} and flows through {len(r.countries)} countries.</p>"
        return ""
