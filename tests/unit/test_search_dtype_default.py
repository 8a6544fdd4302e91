"""The search API's default precision is the CLI's (issue 39 item 12): ``SearchOptions()`` means what
``autotune search`` without ``--dtype`` means, so a cluster whose devices lack bf16 searches in the
precision they have instead of refusing every plan (which is how the storage contract suite failed on
a CPU without native bf16)."""

from __future__ import annotations

import inspect

from autotune.commands.search import command as search_command
from autotune.search import SearchOptions, search
from autotune.specs import load_cluster


def test_the_api_default_is_the_cli_default():
    cli_default = inspect.signature(search_command).parameters["dtype"].default
    assert SearchOptions().dtype == cli_default


def test_default_options_search_a_cluster_without_bf16_in_its_precision(tmp_path):
    from autotune.plan import choose_dtype
    from autotune.specs import load_model

    c = tmp_path / "v100.yaml"
    c.write_text("nodes:\n  - {count: 1, devices_per_node: 2, device: V100}\n")
    cluster = load_cluster(str(c))
    res = search(load_model("tiny"), cluster, 256, 8, study_name="v100-auto", storage=":memory:",
                 options=SearchOptions(trials=5, polish=False))
    assert res.best.plan.dtype == choose_dtype("auto", cluster) == "fp16"
