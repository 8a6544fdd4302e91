"""The estimate's per-rank table groups consecutive ranks by what it prints (commands/estimate._rank_ranges):
a CP shard whose windowed work differs below the printed digits no longer takes a line of its own."""

from rich.text import Text

from autotune.commands.estimate import _rank_ranges


def test_ranks_that_print_the_same_share_a_line_and_any_printed_difference_splits_it():
    rows = [[0, "0", "21.1s", Text("35.4GiB")], [1, "0", "21.1s", Text("35.4GiB")], [2, "0", "21.1s", Text("35.4GiB")],
            [3, "0", "22.7s", Text("35.4GiB")], [4, "1", "22.7s", Text("35.4GiB")],
            [5, "1", "22.7s", Text("35.4GiB", style="red")], [6, "1", "22.7s", Text("35.4GiB")]]
    got = [(r[0], [str(c) for c in r[1:]]) for r in _rank_ranges(rows)]
    assert got == [("0-2", ["0", "21.1s", "35.4GiB"]), ("3", ["0", "22.7s", "35.4GiB"]), ("4", ["1", "22.7s", "35.4GiB"]),
                   ("5", ["1", "22.7s", "35.4GiB"]), ("6", ["1", "22.7s", "35.4GiB"])]


def test_only_consecutive_ranks_are_grouped():
    rows = [[0, "a"], [1, "b"], [2, "a"]]
    assert [r[0] for r in _rank_ranges(rows)] == ["0", "1", "2"]
