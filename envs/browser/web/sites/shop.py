"""The shop: categories with sort and filters, product pages with spec tables, a cart.

The cart (``state["cart"]``: sku -> quantity) is what cart tasks are checked against.
"""

from __future__ import annotations

from .app import Request, Response, State, e, link, not_found, page, table
from .world import CATEGORIES, Product, World

SORTS = {"price_asc": "Price: low to high", "price_desc": "Price: high to low", "rating": "Rating: best first"}


def price(p: float) -> str:
    return f"${p:,.2f}"


class Shop:
    def __init__(self, world: World) -> None:
        self.w = world

    def nav(self, state: State) -> list[tuple[str, str]]:
        n = sum(state.data["cart"].values())
        return [("/", "Shop home"), *((f"/category/{c}", c.capitalize()) for c in CATEGORIES), ("/cart", f"Cart ({n})")]

    def __call__(self, req: Request, state: State) -> Response:
        path = req.path.rstrip("/") or "/"
        if path == "/":
            cats = "".join(f"<li>{link('/category/' + c, c.capitalize())}</li>" for c in CATEGORIES)
            return Response(200, page("Shop", f"<p>Departments:</p><ul>{cats}</ul>", self.nav(state)))
        if path.startswith("/category/") and path[10:] in CATEGORIES:
            return self.category(path[10:], req, state)
        if path.startswith("/product/") and path[9:] in self.w.products:
            return self.product(self.w.products[path[9:]], state)
        if path == "/cart":
            return self.cart(state)
        if path == "/cart/add" and req.method == "POST":
            return self.add(req, state)
        if path == "/cart/remove" and req.method == "POST":
            state.update(lambda d: d["cart"].pop(req.param("sku"), None))
            return Response.redirect("/cart")
        return not_found(path)

    def category(self, cat: str, req: Request, state: State) -> Response:
        noun, spec_name, unit = CATEGORIES[cat]
        items = [p for p in self.w.products.values() if p.category == cat]
        errors = []
        sort = req.param("sort", "price_asc")
        if sort not in SORTS:
            errors.append(f"unknown sort {sort!r}")
            sort = "price_asc"
        for name, attr, keep in (("min_rating", "rating", lambda v, x: v >= x), ("max_price", "price", lambda v, x: v <= x)):
            raw = req.param(name).strip().lstrip("$")
            if raw:
                try:
                    bound = float(raw)
                except ValueError:
                    errors.append(f"{name.replace('_', ' ')} must be a number, got {raw!r}")
                    continue
                items = [p for p in items if keep(getattr(p, attr), bound)]
        if req.param("in_stock"):
            items = [p for p in items if p.stock > 0]
        key = {"price_asc": lambda p: p.price, "price_desc": lambda p: -p.price, "rating": lambda p: -p.rating}[sort]
        items.sort(key=key)
        opts = "".join(f"<option value='{k}'{' selected' if k == sort else ''}>{v}</option>" for k, v in SORTS.items())
        checked = " checked" if req.param("in_stock") else ""
        form = (f"<form action='/category/{cat}' method='get'>"
                f"<label>Sort <select name='sort'>{opts}</select></label> "
                f"<label>Min rating <input type='text' name='min_rating' value='{e(req.param('min_rating'))}'></label> "
                f"<label>Max price <input type='text' name='max_price' value='{e(req.param('max_price'))}'></label> "
                f"<label><input type='checkbox' name='in_stock'{checked}> In stock only</label> "
                "<button type='submit'>Apply filters</button></form>")
        errs = "".join(f"<p class='err'>Error: {e(x)}</p>" for x in errors)
        head = f"<tr><th>Product</th><th>Price</th><th>Rating</th><th>{e(spec_name.capitalize())}</th><th>Stock</th></tr>"
        rows = "".join(f"<tr><td>{link('/product/' + p.sku, p.name)}</td><td>{price(p.price)}</td><td>{p.rating}</td>"
                       f"<td>{p.spec} {unit}</td><td>{p.stock or 'out of stock'}</td></tr>" for p in items)
        body = form + errs + (f"<table>{head}{rows}</table>" if items else "<p>No products match.</p>")
        return Response(200, page(f"{cat.capitalize()} ({len(items)} products)", body, self.nav(state)))

    def product(self, p: Product, state: State, error: str = "") -> Response:
        noun, spec_name, unit = CATEGORIES[p.category]
        box = table([("SKU", p.sku), ("Brand", e(p.brand)), ("Price", price(p.price)), ("Rating", f"{p.rating} / 5"),
                     (e(spec_name.capitalize()), f"{p.spec} {unit}"), ("In stock", str(p.stock))])
        if p.stock:
            buy = (f"<form action='/cart/add' method='post'><input type='hidden' name='sku' value='{p.sku}'>"
                   "<label>Quantity <input type='text' name='quantity' value='1'></label> "
                   "<button type='submit'>Add to cart</button></form>")
        else:
            buy = "<p>Out of stock.</p>"
        err = f"<p class='err'>Error: {e(error)}</p>" if error else ""
        back = link(f"/category/{p.category}", f"Back to {p.category}")
        return Response(200 if not error else 400, page(p.name, box + err + buy + f"<p>{back}</p>", self.nav(state)))

    def add(self, req: Request, state: State) -> Response:
        p = self.w.products.get(req.param("sku"))
        if p is None:
            return not_found("/product/" + req.param("sku"))
        raw = req.param("quantity").strip()
        have = state.data["cart"].get(p.sku, 0)
        if not raw.isdigit() or int(raw) < 1:
            return self.product(p, state, f"quantity must be a whole number of at least 1, got {raw!r}")
        if have + int(raw) > p.stock:
            return self.product(p, state, f"only {p.stock} in stock ({have} already in your cart)")
        state.update(lambda d: d["cart"].__setitem__(p.sku, have + int(raw)))
        return Response.redirect("/cart")

    def cart(self, state: State) -> Response:
        cart = state.data["cart"]
        if not cart:
            return Response(200, page("Your cart", "<p>Your cart is empty.</p>", self.nav(state)))
        rows, total = "", 0.0
        for sku, qty in sorted(cart.items()):
            p = self.w.products[sku]
            total += qty * p.price
            remove = (f"<form action='/cart/remove' method='post'><input type='hidden' name='sku' value='{sku}'>"
                      "<button type='submit'>Remove</button></form>")
            rows += f"<tr><td>{link('/product/' + sku, p.name)}</td><td>{qty}</td><td>{price(p.price)}</td><td>{remove}</td></tr>"
        body = (f"<table><tr><th>Product</th><th>Quantity</th><th>Unit price</th><th></th></tr>{rows}</table>"
                f"<p>Total: {price(total)}</p>")
        return Response(200, page("Your cart", body, self.nav(state)))
