import jax
import pytest

from trjax.world import check_batch_split, make_world, parse_device_spec


@pytest.mark.parametrize("spec,want", [("all", list(range(8))), ("4", [0, 1, 2, 3]), (4, [0, 1, 2, 3]),
                                       ("0-3", [0, 1, 2, 3]), ("2-5", [2, 3, 4, 5]),
                                       ("0,2,5", [0, 2, 5]), (" 7 ", list(range(7)))])
def test_parse_valid(spec, want):
    assert parse_device_spec(spec, 8) == want


@pytest.mark.parametrize("spec,needle", [
    ("0,2,2", "more than once"), ("0-9", "[8, 9]"), ("9", "asks for 9 devices"),
    ("0", "asks for 0 devices"), ("3-1", "reversed"), ("gpu", "not understood"),
    ("0,,1", "not understood"), (1.5, "must be a string"), ("0,8", "[8]"),
])
def test_parse_invalid_names_value(spec, needle):
    with pytest.raises(ValueError) as e:
        parse_device_spec(spec, 8)
    assert needle in str(e.value) and repr(spec) in str(e.value)


def test_batch_split():
    assert check_batch_split(64, 8) == 8
    with pytest.raises(ValueError, match=r"global_batch_size 60 is not divisible by world_size 8; use 56 or 64"):
        check_batch_split(60, 8)
    with pytest.raises(ValueError, match=r"global_batch_size 4 is smaller than world_size 8"):
        check_batch_split(4, 8)
    with pytest.raises(ValueError, match="must be an int"):
        check_batch_split(64.0, 8)


def test_make_world():
    w = make_world("0,2,5", 12)
    assert w.world_size == 3 and w.local_batch_size == 4
    assert [d.id for d in w.devices] == [0, 2, 5]
    assert w.mesh.axis_names == ("data",)
    with pytest.raises(ValueError, match="not divisible"):
        make_world("0-2", 8)
    assert len(jax.devices()) == 8


def test_batch_messages_name_the_field_the_user_set():
    """Issue 13 item 2: eval_batch_size=10 used to say 'global_batch_size 10 is not divisible'."""
    from helpers import small_config
    from trjax.train import config as config_lib
    for field, value, needle in [
            ("eval_batch_size", 10, "config.eval_batch_size 10 is not divisible by world_size 8; "
                                    "use 8 or 16 (local batch 1 or 2)"),
            ("eval_batch_size", 4, "config.eval_batch_size 4 is smaller than world_size 8"),
            ("global_batch_size", 100, "config.global_batch_size 100 is not divisible by "
                                       "world_size 8; use 96 or 104")]:
        with pytest.raises(ValueError) as e:
            config_lib.validate(small_config(**{field: value}), 8)
        assert needle in str(e.value)
        other = "global_batch_size" if field == "eval_batch_size" else "eval_batch_size"
        assert other not in str(e.value)
    with pytest.raises(ValueError, match=r"^config.eval_batch_size 3 is not divisible by "
                                         r"world_size 2; use 2 or 4 \(local batch 1 or 2\)"):
        check_batch_split(3, 2, "config.eval_batch_size")
