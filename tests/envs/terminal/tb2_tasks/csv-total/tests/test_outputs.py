from pathlib import Path


def test_total_is_the_sum_of_the_amount_column():
    assert Path("/app/total.txt").read_text().strip() == "542"


def test_the_input_is_unchanged():
    assert Path("/app/sales.csv").read_text().count("\n") == 5
