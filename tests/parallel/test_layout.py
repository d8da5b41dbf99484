"""Layout.parse: the one place where a layout string is read and checked against the world size."""

import pytest

from meshtrain.errors import ConfigError, LayoutError
from meshtrain.parallel.layout import Layout


def test_layout_error_is_a_value_error():
    assert issubclass(LayoutError, ConfigError)
    assert issubclass(LayoutError, ValueError)


@pytest.mark.parametrize("spec", ["dp=2", " dp = 2 ", "DP=2", "dp=2,", {"dp": 2}])
def test_explicit_dp_degree(spec):
    layout = Layout.parse(spec, 2)
    assert layout.degrees == {"dp": 2}
    assert layout.batch_degree == 2
    assert layout.world_size == 2
    assert layout.mesh_shape == (2,)
    assert layout.axis_names == ("dp",)


@pytest.mark.parametrize("spec", ["dp=auto", "dp=-1", "dp=AUTO", {"dp": "auto"}])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_auto_fills_the_world(spec, world):
    layout = Layout.parse(spec, world)
    assert layout.batch_degree == world
    assert layout.world_size == world


@pytest.mark.parametrize("spec", [None, "", "   "])
@pytest.mark.parametrize("world", [1, 3])
def test_no_layout_means_data_parallel_over_the_world(spec, world):
    layout = Layout.parse(spec, world)
    assert layout.batch_degree == world
    assert layout.world_size == world


def test_degree_one_axes_are_dropped_and_a_layout_parses_again():
    single = Layout.parse("dp=1", 1)
    assert single.degrees == {}
    assert single.batch_degree == 1
    assert single.world_size == 1
    assert single.build_mesh("cpu") is None  # one process needs no mesh
    layout = Layout.parse("dp=4", 4)
    assert Layout.parse(layout, 4) == layout
    assert Layout.parse(str(layout), 4) == layout


def test_str():
    assert str(Layout.parse("dp=2", 2)) == "dp=2"
    assert str(Layout.parse("dp=auto", 8)) == "dp=8"
    assert str(Layout.parse(None, 1)) == "single"


@pytest.mark.parametrize("spec,world", [("dp=2", 4), ("dp=4", 2), ("dp=3", 1), ("dp=1", 2)])
def test_degrees_must_multiply_to_the_world_size(spec, world):
    with pytest.raises(LayoutError) as info:
        Layout.parse(spec, world)
    message = str(info.value)
    assert f"world size is {world}" in message
    # the fix: start the right number of processes, or change the degrees / use auto
    assert "devices=" in message and "auto" in message


def test_unknown_axis_lists_the_known_ones():
    with pytest.raises(LayoutError, match=r"unknown layout axis 'foo'.*known axes: pp, "
                       r"dp_replicate, dp, dp_shard, cp, tp, zero1, zero2, zero3"):
        Layout.parse("foo=2", 2)


@pytest.mark.parametrize("spec,world,shape,names", [
    ("pp=2,tp=2", 4, (2, 2), ("pp", "tp")),
    ("tp=2,pp=2", 4, (2, 2), ("pp", "tp")),  # mesh order is fixed, whatever the string's
    ("pp=2,dp_shard=2,tp=2", 8, (2, 2, 2), ("pp", "dp_shard", "tp")),
    ("dp=2,tp=auto", 8, (2, 4), ("dp", "tp")),
])
def test_model_parallel_axes_take_their_place_in_the_mesh(spec, world, shape, names):
    layout = Layout.parse(spec, world)
    assert layout.mesh_shape == shape and layout.axis_names == names
    # tensor- and pipeline-parallel ranks see the same data
    assert layout.batch_degree == world // (layout.degree("pp") * layout.degree("tp"))


def test_zero1_only_with_plain_data_parallelism():
    with pytest.raises(LayoutError, match="zero1 is available with plain data parallelism"):
        Layout.parse("zero1=2,tp=2", 4)


@pytest.mark.parametrize("spec,expected", [
    ("dp:2", "axis=degree pairs, e.g. 'dp=2'"),
    ("dp", "axis=degree pairs"),
    ("=2", "axis=degree pairs"),
    ("dp=2 dp=2", "axis=degree pairs"),
    ("dp=x", "positive integer or 'auto'"),
    ("dp=1.5", "positive integer or 'auto'"),
    ("dp=0", "at least 1"),
    ("dp=-2", "at least 1"),
    ("dp=2,dp=2", "appears twice"),
    ("dp=auto,DP=auto", "appears twice"),
])
def test_bad_syntax(spec, expected):
    with pytest.raises(LayoutError) as info:
        Layout.parse(spec, 2)
    assert expected in str(info.value)


def test_two_autos_are_refused(monkeypatch):
    # Only one axis exists today, so two autos need a second axis: patch a test axis in, so that
    # the two-autos check itself (not the unknown-axis check) is what fires.
    from meshtrain.parallel import layout as layout_module

    monkeypatch.setitem(layout_module.AXES, "tp_test", "test axis")
    with pytest.raises(LayoutError, match="only one axis may be 'auto'"):
        Layout.parse("dp=auto,tp_test=auto", 4)
    with pytest.raises(LayoutError, match="only one axis may be 'auto'"):
        Layout.parse("dp=-1,tp_test=auto", 4)


def test_auto_with_a_fixed_degree_that_does_not_divide_the_world(monkeypatch):
    from meshtrain.parallel import layout as layout_module

    monkeypatch.setitem(layout_module.AXES, "tp_test", "test axis")
    layout = Layout.parse("dp=auto,tp_test=2", 4)
    assert layout.degrees == {"dp": 2, "tp_test": 2}
    assert str(layout) == "dp=2,tp_test=2"
    with pytest.raises(LayoutError, match="does not divide the world size 3"):
        Layout.parse("dp=auto,tp_test=2", 3)


@pytest.mark.parametrize("world", [0, -1])
def test_world_size_must_be_positive(world):
    with pytest.raises(LayoutError, match="at least 1"):
        Layout.parse("dp=auto", world)


def test_wrong_type():
    with pytest.raises(LayoutError, match="string like 'dp=2'"):
        Layout.parse(2, 2)


@pytest.mark.parametrize("spec,world,degrees,stage,text", [
    ("zero1=2", 2, {"dp": 2}, 1, "zero1=2"),
    ("zero2=2", 2, {"dp_shard": 2}, 2, "zero2=2"),
    ("zero3=4", 4, {"dp_shard": 4}, 3, "dp_shard=4"),
    ("dp_shard=auto", 4, {"dp_shard": 4}, 3, "dp_shard=4"),
    ("dp_replicate=2,dp_shard=2", 4, {"dp_replicate": 2, "dp_shard": 2}, 3,
     "dp_replicate=2,dp_shard=2"),
    ("dp_replicate=2,zero2=2", 4, {"dp_replicate": 2, "dp_shard": 2}, 2,
     "dp_replicate=2,zero2=2"),
    ("dp=2", 2, {"dp": 2}, 0, "dp=2"),
])
def test_sharded_layouts(spec, world, degrees, stage, text):
    layout = Layout.parse(spec, world)
    assert layout.degrees == degrees
    assert layout.zero_stage == stage
    assert layout.batch_degree == world
    assert str(layout) == text
    assert Layout.parse(text, world) == layout
    assert Layout.parse(layout, world) == layout


@pytest.mark.parametrize("spec,expected", [
    ("dp=2,dp_shard=2", "dp_replicate=2,dp_shard=2"),
    ("dp_replicate=4", "needs dp_shard"),
    ("zero1=2,zero3=2", "two ZeRO stages"),
    ("zero3=2,dp_shard=2", "same axis"),
])
def test_sharded_layout_mistakes(spec, expected):
    with pytest.raises(LayoutError, match=expected):
        Layout.parse(spec, 4)


def test_the_readmes_refused_combinations_are_refused():
    """README's list of combinations refused before start: each example must be refused (and
    the list must not be empty)."""
    import math
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("These combinations are refused before any process starts")[1]
    items = re.findall(r"^- .*?\(`([^`]+)`\)", section.split("\n\n")[1], flags=re.M)
    assert len(items) == 5, items
    for spec in items:
        degrees = dict(part.split("=") for part in spec.split(","))
        world = math.prod(int(v) for k, v in degrees.items() if k not in ("ps", "ep"))
        world += int(degrees.get("ps", 0))  # (ep borrows ranks: it adds none)
        with pytest.raises(LayoutError, match="" if "ep" not in degrees else "cp and pp, not with"):
            Layout.parse(spec, world)


@pytest.mark.parametrize("spec, world, degrees, text", [
    ("ep=2", 2, {"dp": 2}, "dp=2,ep=2"),
    ("ep=2", 4, {"dp": 4}, "dp=4,ep=2"),
    ("zero3=4,ep=2", 4, {"dp_shard": 4}, "dp_shard=4,ep=2"),
    ("zero2=2,ep=2", 2, {"dp_shard": 2}, "zero2=2,ep=2"),
    ("pp=2,ep=2", 4, {"pp": 2, "dp": 2}, "pp=2,dp=2,ep=2"),
    ("dp_replicate=2,zero3=2,ep=2", 4, {"dp_replicate": 2, "dp_shard": 2},
     "dp_replicate=2,dp_shard=2,ep=2"),
    ("dp_replicate=2,dp_shard=2,ep=4", 4, {"dp_replicate": 2, "dp_shard": 2},
     "dp_replicate=2,dp_shard=2,ep=4"),
])
def test_ep_borrows_data_parallel_ranks(spec, world, degrees, text):
    layout = Layout.parse(spec, world)
    assert layout.degrees == degrees and layout.expert_degree == int(text.rsplit("=", 1)[1])
    assert layout.world_size == world and str(layout) == text
    assert Layout.parse(str(layout), world) == layout  # round trip
    assert Layout.processes_of(text) == world  # (ep borrows ranks: no factor of its own)


@pytest.mark.parametrize("spec, world, match", [
    ("ep=3", 2, r"ep=3 borrows its ranks from the data- and context-parallel ranks, which "
                r"are 2; ep must divide it \(e\.g\. ep=2"),
    ("ep=auto", 2, "give the number of ranks"),
    ("ep=0", 2, "at least 1"),
    ("dp_replicate=2,dp_shard=2,ep=8", 4, r"which are 4; ep must divide it"),
    ("tp=2,ep=2", 4, r"not with tp \(not yet together: tp alone splits each expert"),
    ("zero1=2,ep=2", 2, "not with zero1"),
])
def test_ep_mistakes(spec, world, match):
    with pytest.raises(LayoutError, match=match):
        Layout.parse(spec, world)
