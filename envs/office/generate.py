"""The procedural task generator: ``generate(family, seed)`` -> one office task, as plain data.

Pure Python (no document library): a task is its prompt, its documents as descriptions
(``render`` in ``tool/office_tool.py`` writes them), its checks (``rewards/office_checks.py``)
and its scripted ``oracle`` and plausible-but-``wrong`` policies (tool calls). The same
``(family, seed)`` always gives the same task. ``build_tasks.py`` renders the shipped set.

Families (``FAMILIES``): lookups in a workbook, a report and a deck; a cross-sheet aggregation;
edits that must keep formulas live (a cost line above a SUM row, a changed input price);
fixing a wrong formula; editing a report and a deck; summarizing a report into slides.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

Task = dict[str, Any]
CATEGORIES = ["Rent", "Salaries", "Marketing", "Travel", "Software", "Hardware", "Training", "Consulting",
              "Utilities", "Insurance", "Legal", "Catering"]
NEW_ITEMS = ["Cloud hosting", "Recruiting", "Office supplies", "Conferences", "Licences", "Maintenance"]
PRODUCTS = ["Widget", "Gadget", "Sprocket", "Gizmo", "Doohickey", "Flange", "Bracket", "Valve"]
REGIONS = ["North", "South", "East", "West"]
QUARTERS = ["Q1", "Q2", "Q3", "Q4"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug"]
OFFICES = ["Berlin", "Lisbon", "Oslo", "Toronto", "Nairobi", "Osaka", "Lima", "Austin"]
PROJECTS = ["Falcon", "Heron", "Osprey", "Kestrel", "Condor", "Puffin", "Ibis", "Plover"]
COMPANIES = ["Northwind", "Contoso", "Fabrikam", "Tailspin", "Litware", "Adatum"]
STEPS = ["Hire two analysts", "Renew the vendor contract", "Launch the pilot", "Review the budget",
         "Migrate the database", "Train the support team", "Publish the roadmap"]
METRICS = [("Revenue", "revenue reached {v} kUSD"), ("Customers", "active customers reached {v}"),
           ("Costs", "operating costs were {v} kUSD"), ("Hiring", "headcount grew to {v}"),
           ("Support", "support tickets totalled {v}"), ("Exports", "export orders reached {v}")]


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def read(path: str, part: str | None = None) -> dict[str, Any]:
    return call("read_document", path=path, **({"part": part} if part else {}))


def answer(text: Any) -> list[dict[str, Any]]:
    return [call("answer", text=str(text))]


def edit(path: str, op: str, **arguments: Any) -> list[dict[str, Any]]:
    return [call("edit_document", path=path, op=op, **arguments)]


def _amounts(rng: random.Random, n: int, lo: int = 200, hi: int = 5000) -> list[int]:
    return rng.sample(range(lo, hi, 10), n)  # distinct, so a neighbouring cell is always a wrong answer


def _sheet(name: str, rows: list[list[Any]]) -> dict[str, Any]:
    return {"name": name, "rows": rows}


def budget_lookup(rng: random.Random) -> Task:
    cats = rng.sample(CATEGORIES, 6)
    vals = [_amounts(rng, 3) for _ in cats]
    rows = [["Category", "Jan", "Feb", "Mar", "Q1 total"]]
    rows += [[c, *v, f"=SUM(B{r}:D{r})"] for r, (c, v) in enumerate(zip(cats, vals), start=2)]
    rows.append(["Total", *[f"=SUM({col}2:{col}7)" for col in "BCDE"]])
    i = rng.randrange(6)
    if rng.random() < 0.5:
        prompt = f"In budget.xlsx, what is the Q1 total budget of {cats[i]}? Answer with the number."
        right, wrong = sum(vals[i]), vals[i][2]
    else:
        m = rng.randrange(3)
        prompt = f"In budget.xlsx, what is the total {MONTHS[m]} budget over all categories? Answer with the number."
        right, wrong = sum(v[m] for v in vals), sum(v[(m + 1) % 3] for v in vals)
    files = {"budget.xlsx": {"kind": "xlsx", "sheets": [_sheet("Budget", rows)]}}
    look = [read("budget.xlsx", "Budget")]
    return {"prompt": prompt, "files": files, "checks": [{"type": "answer", "number": right}],
            "policies": {"oracle": [look, answer(right)], "wrong": [look, answer(wrong)]}}


def regional_sum(rng: random.Random) -> Task:
    prods = rng.sample(PRODUCTS, 4)
    data = {reg: [_amounts(rng, 4, 100, 900) for _ in prods] for reg in REGIONS}
    sheets = [_sheet(reg, [["Product", *QUARTERS], *[[p, *v] for p, v in zip(prods, data[reg])]]) for reg in REGIONS]
    sheets.append(_sheet("Summary", [["Region", "Total"], *[[reg, f"=SUM({reg}!B2:E5)"] for reg in REGIONS]]))
    files = {"sales.xlsx": {"kind": "xlsx", "sheets": sheets}}
    look = [read("sales.xlsx", reg) for reg in REGIONS]
    if rng.random() < 0.6:
        p, q = rng.randrange(4), rng.randrange(4)
        prompt = (f"sales.xlsx has one sheet per region. What were the total {QUARTERS[q]} sales of {prods[p]} "
                  "across all regions, in units? Answer with the number.")
        right = sum(data[reg][p][q] for reg in REGIONS)
        wrong = sum(data[reg][p][(q + 1) % 4] for reg in REGIONS)
        check = {"type": "answer", "number": right}
    else:
        totals = sorted(((sum(map(sum, data[reg])), reg) for reg in REGIONS), reverse=True)
        prompt = "In sales.xlsx, which region had the highest total sales over the year? Answer with its name."
        right, wrong = totals[0][1], totals[1][1]
        check = {"type": "answer", "text": right}
        look = [read("sales.xlsx", "Summary")]
    return {"prompt": prompt, "files": files, "checks": [check],
            "policies": {"oracle": [look, answer(right)], "wrong": [look, answer(wrong)]}}


def add_cost_line(rng: random.Random) -> Task:
    n = rng.randrange(4, 7)
    items, amounts = rng.sample(CATEGORIES, n), _amounts(rng, n)
    total, t = sum(amounts), n + 2  # items in rows 2..n+1, the Total row is t
    budget = total + rng.randrange(2000, 6000, 100)
    new, amount = rng.choice(NEW_ITEMS), rng.randrange(300, 1500, 10)
    costs = [["Item", "Amount"], *[[a, b] for a, b in zip(items, amounts)], ["Total", f"=SUM(B2:B{n + 1})"]]
    summary = [["Measure", "Amount"], ["Total costs", f"=Costs!B{t}"], ["Budget", budget], ["Remaining", "=B3-B2"]]
    files = {"budget.xlsx": {"kind": "xlsx", "sheets": [_sheet("Costs", costs), _sheet("Summary", summary)]}}
    prompt = (f"In budget.xlsx, add a cost line '{new}' of {amount} to the Costs sheet, directly above the "
              "Total row. The Total, and the Summary sheet that uses it, must include the new line and stay formulas.")
    new_total = total + amount
    checks = [
        {"type": "cell_value", "path": "budget.xlsx", "sheet": "Costs", "cell": f"A{t}", "equals": new},
        {"type": "cell_value", "path": "budget.xlsx", "sheet": "Costs", "cell": f"B{t}", "equals": amount},
        {"type": "cell_value", "path": "budget.xlsx", "sheet": "Costs", "cell": f"B{t + 1}", "equals": new_total},
        {"type": "cell_formula", "path": "budget.xlsx", "sheet": "Costs", "cell": f"B{t + 1}"},
        {"type": "cell_value", "path": "budget.xlsx", "sheet": "Summary", "cell": "B2", "equals": new_total},
        {"type": "cell_value", "path": "budget.xlsx", "sheet": "Summary", "cell": "B4", "equals": budget - new_total},
    ]
    insert = edit("budget.xlsx", "insert_row", sheet="Costs", row=t, values=[new, amount])
    fix = edit("budget.xlsx", "set_cell", sheet="Costs", cell=f"B{t + 1}", value=f"=SUM(B2:B{t})")
    literal = edit("budget.xlsx", "set_cell", sheet="Costs", cell=f"B{t + 1}", value=new_total)
    look = [read("budget.xlsx")]
    # wrong: trust the SUM to grow (it does not: the row went in below its range), or type the total in
    wrong = [look, insert, answer("done")] if rng.random() < 0.5 else [look, insert, literal, answer("done")]
    return {"prompt": prompt, "files": files, "checks": checks,
            "policies": {"oracle": [look, insert, fix, answer("done")], "wrong": wrong}}


def price_update(rng: random.Random) -> Task:
    prods = rng.sample(PRODUCTS, 4)
    prices = rng.sample(range(5, 60), 4)
    orders = [rng.randrange(4) for _ in range(6)]
    k = orders[rng.randrange(6)]  # a product that has orders
    new_price = prices[k] + rng.choice([-3, -2, 2, 3, 4, 5])
    price_rows = [["Product", "Unit price"], *[[p, c] for p, c in zip(prods, prices)]]
    qty = [rng.randrange(1, 40) for _ in orders]
    order_rows = [["Order", "Product", "Qty", "Amount"]]
    order_rows += [[f"SO-{100 + i}", prods[o], q, f"=C{i + 2}*Prices!B{o + 2}"] for i, (o, q) in enumerate(zip(orders, qty))]
    order_rows.append(["Total", "", "", "=SUM(D2:D7)"])
    files = {"orders.xlsx": {"kind": "xlsx", "sheets": [_sheet("Prices", price_rows), _sheet("Orders", order_rows)]}}
    prompt = (f"The unit price of {prods[k]} is now {new_price}. Update orders.xlsx so that every order amount "
              "and the total reflect the new price; keep the amounts and the total as formulas.")
    new_prices = [new_price if i == k else c for i, c in enumerate(prices)]
    total = sum(q * new_prices[o] for o, q in zip(orders, qty))
    checks = [{"type": "cell_value", "path": "orders.xlsx", "sheet": "Prices", "cell": f"B{k + 2}", "equals": new_price},
              {"type": "cell_value", "path": "orders.xlsx", "sheet": "Orders", "cell": "D8", "equals": total},
              {"type": "cell_formula", "path": "orders.xlsx", "sheet": "Orders", "cell": "D8"}]
    for i, (o, q) in enumerate(zip(orders, qty)):
        if o == k:
            checks += [{"type": "cell_value", "path": "orders.xlsx", "sheet": "Orders", "cell": f"D{i + 2}",
                        "equals": q * new_price},
                       {"type": "cell_formula", "path": "orders.xlsx", "sheet": "Orders", "cell": f"D{i + 2}"}]
    look = [read("orders.xlsx", "Prices")]
    j = (k + 1) % 4  # wrong: the price goes on the neighbouring product's row
    return {"prompt": prompt, "files": files, "checks": checks, "policies": {
        "oracle": [look, edit("orders.xlsx", "set_cell", sheet="Prices", cell=f"B{k + 2}", value=new_price), answer("done")],
        "wrong": [look, edit("orders.xlsx", "set_cell", sheet="Prices", cell=f"B{j + 2}", value=new_price), answer("done")]}}


def fix_formula(rng: random.Random) -> Task:
    rev, cost = _amounts(rng, 6, 2000, 9000), _amounts(rng, 6, 500, 1900)
    rows = [["Month", "Revenue", "Cost", "Profit"]]
    rows += [[m, r, c, f"=B{i}-C{i}"] for i, (m, r, c) in enumerate(zip(MONTHS, rev, cost), start=2)]
    rows.append(["Total", "=SUM(B2:B7)", "=SUM(C2:C7)", "=SUM(D2:D7)"])
    profit = sum(rev) - sum(cost)
    summary = [["Measure", "Value"], ["Margin", "=Sales!D8/Sales!B8"]]
    checks = [{"type": "cell_value", "path": "report.xlsx", "sheet": "Sales", "cell": "D8", "equals": profit},
              {"type": "cell_value", "path": "report.xlsx", "sheet": "Summary", "cell": "B2", "equals": profit / sum(rev)}]
    if rng.random() < 0.5:
        rows[-1][3] = "=SUM(D2:D6)"  # the bug: the total leaves out the last month
        prompt = ("In report.xlsx, the Profit total in Sales!D8 leaves out a month, and so does the Margin on the "
                  "Summary sheet. Fix the formula.")
        checks.append({"type": "cell_formula", "path": "report.xlsx", "sheet": "Sales", "cell": "D8"})
        fix = edit("report.xlsx", "set_cell", sheet="Sales", cell="D8", value="=SUM(D2:D7)")
        wrong = edit("report.xlsx", "set_cell", sheet="Sales", cell="D8", value=profit)  # right number, no formula
    else:
        r = rng.randrange(2, 8)
        rows[r - 1][3] = f"=B{r}+C{r}"  # the bug: a plus for a minus
        prompt = (f"In report.xlsx, the Profit of {MONTHS[r - 2]} on the Sales sheet is computed wrongly "
                  "(profit is revenue minus cost), which also breaks the totals. Fix the formula.")
        checks += [{"type": "cell_value", "path": "report.xlsx", "sheet": "Sales", "cell": f"D{r}",
                    "equals": rev[r - 2] - cost[r - 2]},
                   {"type": "cell_formula", "path": "report.xlsx", "sheet": "Sales", "cell": f"D{r}"}]
        fix = edit("report.xlsx", "set_cell", sheet="Sales", cell=f"D{r}", value=f"=B{r}-C{r}")
        s = r + 1 if r < 7 else r - 1  # wrong: the neighbouring month's (correct) formula is rewritten
        wrong = edit("report.xlsx", "set_cell", sheet="Sales", cell=f"D{s}", value=f"=B{s}-C{s}")
    files = {"report.xlsx": {"kind": "xlsx", "sheets": [_sheet("Sales", rows), _sheet("Summary", summary)]}}
    look = [read("report.xlsx", "Sales")]
    return {"prompt": prompt, "files": files, "checks": checks,
            "policies": {"oracle": [look, fix, answer("done")], "wrong": [look, wrong, answer("done")]}}


def _report(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    """A quarterly report (docx description) and the facts it states."""
    company, offices, projects = rng.choice(COMPANIES), rng.sample(OFFICES, 5), rng.sample(PROJECTS, 3)
    heads, revs = rng.sample(range(12, 240), 5), _amounts(rng, 5, 300, 4000)
    budgets, growth = rng.sample(range(40, 400, 5), 3), rng.randrange(2, 19)
    blocks = [
        {"heading": f"{company} quarterly report", "level": 0},
        {"heading": "Summary", "level": 1},
        {"paragraph": f"Revenue grew by {growth}% this quarter. Project {projects[0]} remains the largest investment."},
        {"heading": "Offices", "level": 1},
        {"paragraph": "Headcount and revenue by office (revenue in kUSD):"},
        {"table": [["Office", "Headcount", "Revenue"], *[[o, h, r] for o, h, r in zip(offices, heads, revs)]]},
        {"heading": "Projects", "level": 1},
        {"bullets": [f"Project {p}: budget {b} kUSD" for p, b in zip(projects, budgets)]},
        {"heading": "Outlook", "level": 1},
        {"paragraph": f"{company} expects stable demand next quarter."},
    ]
    facts = {"company": company, "offices": offices, "heads": heads, "revs": revs, "projects": projects,
             "budgets": budgets, "growth": growth,
             "sections": {"Summary": 2, "Offices": 4, "Projects": 8, "Outlook": 10}}  # last paragraph index of each
    return {"kind": "docx", "blocks": blocks}, facts


def report_lookup(rng: random.Random) -> Task:
    doc, f = _report(rng)
    kind, i = rng.randrange(3), rng.randrange(5)
    if kind == 0:
        prompt = f"According to report.docx, what is the headcount of the {f['offices'][i]} office? Answer with the number."
        right, wrong = f["heads"][i], f["heads"][(i + 1) % 5]
        check = {"type": "answer", "number": right}
    elif kind == 1:
        ranked = sorted(zip(f["revs"], f["offices"]), reverse=True)
        prompt = "According to report.docx, which office had the highest revenue? Answer with the office name."
        right, wrong = ranked[0][1], ranked[1][1]
        check = {"type": "answer", "text": right}
    else:
        j = i % 3
        prompt = f"According to report.docx, what is the budget of Project {f['projects'][j]}, in USD? Answer with the number."
        right, wrong = f"{f['budgets'][j] * 1000:,}", f["budgets"][j]  # wrong: kUSD read as USD
        check = {"type": "answer", "number": f["budgets"][j] * 1000, "unit": "USD"}
    look = [read("report.docx")]
    return {"prompt": prompt, "files": {"report.docx": doc}, "checks": [check],
            "policies": {"oracle": [look, answer(right)], "wrong": [look, answer(wrong)]}}


def report_edit(rng: random.Random) -> Task:
    doc, f = _report(rng)
    old = f["projects"][0]
    new = rng.choice([p for p in PROJECTS if p not in f["projects"]])
    i, n = rng.randrange(5), rng.randrange(250, 400)
    prompt = (f"In report.docx, Project {old} was renamed Project {new}: update every mention. Also set the "
              f"headcount of the {f['offices'][i]} office in the offices table to {n}.")
    checks = [{"type": "text_absent", "path": "report.docx", "text": f"Project {old}"},
              {"type": "paragraph_contains", "path": "report.docx", "text": f"Project {new}"},
              {"type": "table_cell", "path": "report.docx", "table": 0, "row": i + 1, "col": 1, "text": str(n)}]
    rename = edit("report.docx", "replace_text", find=f"Project {old}", replace=f"Project {new}")
    look = [read("report.docx")]
    cell = edit("report.docx", "set_table_cell", table=0, row=i + 1, col=1, text=str(n))
    off_by_one = edit("report.docx", "set_table_cell", table=0, row=(i + 1) % 5 + 1, col=1, text=str(n))
    return {"prompt": prompt, "files": {"report.docx": doc}, "checks": checks,
            "policies": {"oracle": [look, rename, cell, answer("done")], "wrong": [look, rename, off_by_one, answer("done")]}}


def report_add_paragraph(rng: random.Random) -> Task:
    doc, f = _report(rng)
    section = rng.choice(["Summary", "Offices", "Projects"])  # never the last one: appending would look right
    sentence = f"Note: figures for {rng.choice(f['offices'])} were revised on {rng.randrange(2, 28)} March."
    prompt = f"Add the sentence \"{sentence}\" as a new paragraph at the end of the {section} section of report.docx."
    checks = [{"type": "paragraph_in_section", "path": "report.docx", "section": section, "text": sentence}]
    look = [read("report.docx", "paragraphs")]
    oracle = edit("report.docx", "add_paragraph", text=sentence, after=f["sections"][section])
    wrong = edit("report.docx", "add_paragraph", text=sentence)  # at the end of the document
    return {"prompt": prompt, "files": {"report.docx": doc}, "checks": checks,
            "policies": {"oracle": [look, oracle, answer("done")], "wrong": [look, wrong, answer("done")]}}


def _deck(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    company = rng.choice(COMPANIES)
    rev, profit = _amounts(rng, 4, 800, 3000), _amounts(rng, 4, 50, 700)
    customers, tickets = rng.randrange(500, 5000), rng.randrange(100, 900)
    slides = [
        {"title": f"{company} business review", "subtitle": "Quarterly update"},
        {"title": "Agenda", "bullets": ["Quarterly results", "Highlights", "Next steps"]},
        {"title": "Quarterly results", "table": [["Quarter", "Revenue", "Profit"],
                                                 *[[q, r, p] for q, r, p in zip(QUARTERS, rev, profit)]]},
        {"title": "Highlights", "bullets": [f"Active customers: {customers}", f"Support tickets: {tickets}",
                                            f"New offices: {rng.randrange(2, 6)}"]},
    ]
    return {"kind": "pptx", "slides": slides}, {"rev": rev, "profit": profit, "customers": customers,
                                                "tickets": tickets, "titles": [s["title"] for s in slides]}


def deck_lookup(rng: random.Random) -> Task:
    doc, f = _deck(rng)
    q = rng.randrange(4)
    if rng.random() < 0.6:
        prompt = f"In deck.pptx, what was the profit in {QUARTERS[q]}? Answer with the number."
        right, wrong, look = f["profit"][q], f["rev"][q], [read("deck.pptx", "slide:2")]
    else:
        prompt = "According to deck.pptx, how many active customers are there? Answer with the number."
        right, wrong, look = f["customers"], f["tickets"], [read("deck.pptx")]
    return {"prompt": prompt, "files": {"deck.pptx": doc}, "checks": [{"type": "answer", "number": right}],
            "policies": {"oracle": [look, answer(right)], "wrong": [look, answer(wrong)]}}


def deck_edit(rng: random.Random) -> Task:
    doc, f = _deck(rng)
    i = rng.choice([2, 3])
    right = f["titles"][i]
    w = rng.randrange(len(right) - 2)
    typo = right[:w] + right[w + 1] + right[w] + right[w + 2:]  # two letters swapped
    if typo == right:
        typo = right + right[-1]
    doc["slides"][i]["title"] = typo
    steps = rng.sample(STEPS, 3)
    prompt = (f"In deck.pptx, the title of slide {i} (counting from 0) has a typo: \"{typo}\" should read "
              f"\"{right}\". Fix it, and add a final slide titled \"Next steps\" with the bullets: "
              + "; ".join(steps) + ".")
    titles = [*f["titles"], "Next steps"]
    checks = [{"type": "slide_count", "path": "deck.pptx", "count": 5},
              {"type": "slide_titles", "path": "deck.pptx", "titles": titles},
              *[{"type": "slide_contains", "path": "deck.pptx", "slide": 4, "text": s} for s in steps]]
    look = [read("deck.pptx")]
    fix = edit("deck.pptx", "replace_text", find=typo, replace=right)
    add = edit("deck.pptx", "add_slide", title="Next steps", bullets=steps)
    return {"prompt": prompt, "files": {"deck.pptx": doc}, "checks": checks,
            "policies": {"oracle": [look, fix, add, answer("done")], "wrong": [look, add, answer("done")]}}


def report_to_slides(rng: random.Random) -> Task:
    company, k = rng.choice(COMPANIES), rng.randrange(3, 5)
    metrics = rng.sample(METRICS, k)
    values = [f"{v:,}" for v in rng.sample(range(120, 9000), k)]
    blocks: list[dict[str, Any]] = [{"heading": f"{company} annual summary", "level": 0}]
    for (name, sentence), v in zip(metrics, values):
        blocks += [{"heading": name, "level": 1},
                   {"paragraph": f"Key figure: {sentence.format(v=v)}."},
                   {"paragraph": f"The {name.lower()} team reviewed the year in detail."}]
    title = f"{company} annual summary"
    deck = {"kind": "pptx", "slides": [{"title": title, "subtitle": "Board meeting"}]}
    prompt = ("Summarize report.docx in summary.pptx: after the existing title slide, add one slide per section of "
              "the report, in the report's order, titled with the section's heading, with a bullet giving that "
              "section's key figure.")
    headings = [m[0] for m in metrics]
    checks = [{"type": "slide_count", "path": "summary.pptx", "count": k + 1},
              {"type": "slide_titles", "path": "summary.pptx", "titles": [title, *headings]},
              *[{"type": "slide_contains", "path": "summary.pptx", "slide": j + 1, "text": v} for j, v in enumerate(values)]]
    adds = [edit("summary.pptx", "add_slide", title=name, bullets=[f"Key figure: {s.format(v=v)}"])
            for (name, s), v in zip(metrics, values)]
    look = [read("report.docx", "paragraphs")]
    return {"prompt": prompt, "files": {"report.docx": {"kind": "docx", "blocks": blocks}, "summary.pptx": deck},
            "checks": checks, "max_turns": 12,
            "policies": {"oracle": [look, *adds, answer("done")],
                         "wrong": [look, *adds[:-1], answer("done")]}}  # wrong: the last section is left out


FAMILIES: dict[str, Callable[[random.Random], Task]] = {
    "budget-lookup": budget_lookup, "regional-sum": regional_sum, "add-cost-line": add_cost_line,
    "price-update": price_update, "fix-formula": fix_formula, "report-lookup": report_lookup,
    "report-edit": report_edit, "report-add-paragraph": report_add_paragraph, "deck-lookup": deck_lookup,
    "deck-edit": deck_edit, "report-to-slides": report_to_slides,
}


def set_cell(rng: random.Random) -> Task:
    """Easy (EASY_FAMILIES): every argument of the one edit is in the prompt, nothing to read or compute."""
    cats = rng.sample(CATEGORIES, 5)
    rows = [["Category", "Amount"], *[[c, a] for c, a in zip(cats, _amounts(rng, 5))]]
    r, value = rng.randrange(2, 7), rng.randrange(100, 999)
    prompt = f"In log.xlsx, set cell B{r} of sheet Log to {value}."
    checks = [{"type": "cell_value", "path": "log.xlsx", "sheet": "Log", "cell": f"B{r}", "equals": value}]
    right = edit("log.xlsx", "set_cell", sheet="Log", cell=f"B{r}", value=str(value))
    below = edit("log.xlsx", "set_cell", sheet="Log", cell=f"B{r + 1}", value=str(value))  # the row under it
    files = {"log.xlsx": {"kind": "xlsx", "sheets": [_sheet("Log", rows)]}}
    return {"prompt": prompt, "files": files, "checks": checks,
            "policies": {"oracle": [right, answer("done")], "wrong": [below, answer("done")]}}


def replace_word(rng: random.Random) -> Task:
    """Easy (EASY_FAMILIES): one replace_text whose two words the prompt gives."""
    old, new, other = rng.sample(PROJECTS, 3)
    doc = {"kind": "docx", "blocks": [{"heading": "Memo", "level": 0},
                                      {"paragraph": f"Project {old} starts in {rng.choice(MONTHS)}."},
                                      {"paragraph": f"Send questions about {old} to the project office."}]}
    prompt = f"In memo.docx, replace the word {old} with {new} everywhere."
    checks = [{"type": "text_absent", "path": "memo.docx", "text": old},
              {"type": "paragraph_contains", "path": "memo.docx", "text": f"Project {new}"}]
    right = edit("memo.docx", "replace_text", find=old, replace=new)
    slip = edit("memo.docx", "replace_text", find=old, replace=other)  # another project's name
    return {"prompt": prompt, "files": {"memo.docx": doc}, "checks": checks,
            "policies": {"oracle": [right, answer("done")], "wrong": [slip, answer("done")]}}


# Easier families, not in the shipped set (build them with build_tasks --families): one copied edit
# each, for a model too small to solve the others (docs/recipe.md, the five-domain recipe).
EASY_FAMILIES: dict[str, Callable[[random.Random], Task]] = {"set-cell": set_cell, "replace-word": replace_word}


def generate(family: str, seed: int) -> Task:
    """One task of ``family`` (``FAMILIES`` or ``EASY_FAMILIES``); the same seed gives the same task."""
    every = {**FAMILIES, **EASY_FAMILIES}
    if family not in every:
        raise ValueError(f"unknown office task family {family!r}; available: {sorted(every)}")
    task = every[family](random.Random(f"{family}/{seed}"))
    return {"id": f"{family}-{seed}", "family": family, "seed": seed, "max_turns": 10, **task}
