"""Segment plans and flat storage (node/model/segments.py).

Protects docs/design.md §4: segment plans and fingerprints, and flat storage that the
module and optimizer really use.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from gossipd.node.errors import (
    MeshMismatch,
)
from gossipd.node.model.segments import (
    FlatModel,
    check_fingerprint,
    plan_segments,
    shareable_tensors,
)
from tests.tensors import F16, F32, F64, named


# ----------------------------------------------------------------------------------
# Segment plans
# ----------------------------------------------------------------------------------
def test_plan_packs_tensors_in_order_up_to_segment_bytes():
    # four 40-byte float32 tensors, 100-byte segments: [a, b], [c, d]
    plan = plan_segments(named(*[(n, (10,), F32) for n in "abcd"]), segment_bytes=100)
    assert [[t.name for t in s.tensors] for s in plan.segments] == [["a", "b"], ["c", "d"]]
    assert [s.index for s in plan.segments] == [0, 1]
    assert [s.nbytes for s in plan.segments] == [80, 80]
    assert plan.nbytes == 160
    assert len(plan) == 2


def test_plan_segments_never_exceed_segment_bytes_unless_one_tensor_does():
    sizes = [3, 17, 1, 64, 5, 5, 5, 300, 2, 2, 40]
    tensors = named(*[(f"t{i}", (n,), F32) for i, n in enumerate(sizes)])
    plan = plan_segments(tensors, segment_bytes=128)
    flat_names = [t.name for s in plan.segments for t in s.tensors]
    assert flat_names == [name for name, _ in tensors]  # order kept, nothing lost or repeated
    for seg in plan.segments:
        assert seg.nbytes <= 128 or len(seg.tensors) == 1


def test_tensor_larger_than_segment_bytes_forms_a_segment_alone():
    plan = plan_segments(
        named(("small1", (4,), F32), ("big", (1000,), F32), ("small2", (4,), F32)),
        segment_bytes=64,
    )
    assert [[t.name for t in s.tensors] for s in plan.segments] == [
        ["small1"],
        ["big"],
        ["small2"],
    ]
    assert plan.segments[1].nbytes == 4000


def test_every_segment_holds_a_single_dtype_and_a_dtype_change_starts_a_new_one():
    tensors = named(
        ("a", (2,), F32),
        ("b", (2,), F32),
        ("c", (2,), F64),
        ("d", (2,), F16),
        ("e", (2,), F16),
        ("f", (2,), F32),
    )
    plan = plan_segments(tensors, segment_bytes=1 << 20)
    assert [[t.name for t in s.tensors] for s in plan.segments] == [
        ["a", "b"],
        ["c"],
        ["d", "e"],
        ["f"],
    ]
    for seg in plan.segments:
        assert {t.dtype for t in seg.tensors} == {seg.dtype}
    assert [s.nbytes for s in plan.segments] == [16, 16, 8, 8]


@pytest.mark.parametrize("segment_bytes", [0, -1])
def test_plan_refuses_non_positive_segment_bytes_naming_the_value(segment_bytes):
    with pytest.raises(ValueError, match=f"got {segment_bytes}"):
        plan_segments(named(("a", (1,), F32)), segment_bytes)


def test_plan_refuses_an_empty_model():
    with pytest.raises(ValueError, match="no parameters"):
        plan_segments([])


def test_plan_refuses_integer_tensors_naming_them():
    with pytest.raises(ValueError, match=r"'steps'.*torch\.int64"):
        plan_segments([("w", torch.zeros(2)), ("steps", torch.zeros(2, dtype=torch.int64))])


def _fingerprint(specs, segment_bytes=1 << 20) -> str:
    return plan_segments(named(*specs), segment_bytes).fingerprint


BASE = (("enc.weight", (4, 3), F32), ("enc.bias", (4,), F32), ("head", (2, 4), F32))


def test_fingerprint_is_equal_for_identical_models():
    assert _fingerprint(BASE) == _fingerprint(BASE)
    fp = _fingerprint(BASE)
    assert re.fullmatch(r"[0-9a-f]{32}", fp)
    a, b = FlatModel(nn.Linear(3, 4)), FlatModel(nn.Linear(3, 4))  # different values
    assert a.fingerprint == b.fingerprint


@pytest.mark.parametrize(
    "changed",
    [
        (("enc.weight", (3, 4), F32), BASE[1], BASE[2]),  # shape, same numel
        (("enc.weight", (4, 3, 1), F32), BASE[1], BASE[2]),  # rank
        (("enc.W", (4, 3), F32), BASE[1], BASE[2]),  # name
        (("enc.weight", (4, 3), F64), BASE[1], BASE[2]),  # dtype
        (BASE[0], BASE[1]),  # a tensor removed
        (BASE[1], BASE[0], BASE[2]),  # order
    ],
    ids=["shape", "rank", "name", "dtype", "removed", "order"],
)
def test_fingerprint_changes_with_any_name_shape_dtype_or_order(changed):
    assert _fingerprint(changed) != _fingerprint(BASE)


def test_fingerprint_changes_when_segment_bytes_moves_the_cut_points():
    one = plan_segments(named(*BASE), segment_bytes=1 << 20)
    cut = plan_segments(named(*BASE), segment_bytes=64)
    assert len(one) == 1 and len(cut) > 1
    assert one.fingerprint != cut.fingerprint


def test_check_fingerprint_raises_mesh_mismatch_naming_both_fingerprints_and_peer():
    check_fingerprint("abc", "abc", "peer-1")
    with pytest.raises(MeshMismatch, match=r"peer-1.*ours is abc, theirs is abd"):
        check_fingerprint("abc", "abd", "peer-1")


# ----------------------------------------------------------------------------------
# FlatModel
# ----------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    base = flat.data_ptr()
    return base <= tensor.data_ptr() < base + flat.numel() * flat.element_size()


@pytest.mark.parametrize("segment_bytes", [1 << 20, 256, 16])
def test_every_shared_tensor_becomes_a_view_of_its_segment_buffer(segment_bytes):
    net = _net()
    flat = FlatModel(net, segment_bytes=segment_bytes)
    tensors = dict(shareable_tensors(net))
    for seg, buffer in zip(flat.plan.segments, flat.buffers, strict=True):
        assert buffer.dtype == seg.dtype and buffer.numel() == seg.numel
        offset = 0
        for spec in seg.tensors:
            t = tensors[spec.name]
            assert _inside(t, buffer), spec.name
            assert torch.equal(t.flatten(), buffer[offset : offset + spec.numel])
            offset += spec.numel
    flat.check_bound()


def test_binding_keeps_module_output_and_parameter_identity():
    net = _net()
    net.eval()
    x = torch.randn(3, 2, 6, 6, generator=torch.Generator().manual_seed(1))
    before = net(x)
    params = list(net.parameters())
    values = [p.detach().clone() for p in params]
    FlatModel(net, segment_bytes=512)
    assert list(net.parameters()) == params  # same Parameter objects
    for p, v in zip(net.parameters(), values, strict=True):
        assert torch.equal(p, v)
    assert torch.equal(net(x), before)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
    ],
    ids=["sgd", "adam"],
)
def test_optimizer_step_updates_the_flat_buffers(make_opt):
    net = _net()
    opt = make_opt(net.parameters())  # built before binding: must keep working
    flat = FlatModel(net, segment_bytes=512)
    before = [b.clone() for b in flat.buffers]
    x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(2))
    net(x).square().mean().backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, flat.buffers, strict=True))
    tensors = dict(shareable_tensors(net))
    for seg, buffer in zip(flat.plan.segments, flat.buffers, strict=True):
        offset = 0
        for spec in seg.tensors:
            assert torch.equal(
                tensors[spec.name].detach().flatten(), buffer[offset : offset + spec.numel]
            )
            offset += spec.numel
    flat.check_bound()


def test_batchnorm_running_stats_are_shared_but_num_batches_tracked_is_not():
    net = _net()
    flat = FlatModel(net)
    names = {t.name for s in flat.plan.segments for t in s.tensors}
    assert {"bn.running_mean", "bn.running_var", "bn.weight", "bn.bias"} <= names
    assert "bn.num_batches_tracked" not in names
    before = [b.clone() for b in flat.buffers]
    net.train()
    net(torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(3)))
    mean_seg = next(
        s for s in flat.plan.segments if "bn.running_mean" in {t.name for t in s.tensors}
    )
    assert not torch.equal(before[mean_seg.index], flat.buffers[mean_seg.index])
    assert _inside(net.bn.running_mean, flat.buffers[mean_seg.index])
    assert int(net.bn.num_batches_tracked) == 1
    flat.check_bound()


def test_check_bound_fails_loudly_when_a_parameter_is_reassigned():
    net = _net()
    flat = FlatModel(net)
    net.fc.weight.data = net.fc.weight.data.clone()
    with pytest.raises(MeshMismatch, match=r"'fc\.weight'.*segment 0"):
        flat.check_bound()


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 1.0])
def test_merge_segment_computes_convex_combination_in_place(alpha):
    net = nn.Linear(3, 2)
    flat = FlatModel(net)
    x = flat.buffers[0].clone()
    received = torch.randn(
        x.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    flat.merge_segment(0, received, alpha)
    expected = (1 - alpha) * x + alpha * received.to(torch.float32)
    torch.testing.assert_close(flat.buffers[0], expected, rtol=1e-6, atol=1e-7)
    assert flat.buffers[0].dtype == torch.float32
    torch.testing.assert_close(net.weight.detach().flatten(), flat.buffers[0][:6])
    if alpha == 0.0:
        assert torch.equal(flat.buffers[0], x)
    if alpha == 1.0:
        assert torch.equal(flat.buffers[0], received.to(torch.float32))


def test_merge_segment_touches_only_its_segment():
    net = _net()
    flat = FlatModel(net, segment_bytes=256)
    assert len(flat.buffers) > 2
    others = {i: b.clone() for i, b in enumerate(flat.buffers) if i != 1}
    flat.merge_segment(1, torch.zeros_like(flat.buffers[1]), 0.5)
    for i, b in others.items():
        assert torch.equal(flat.buffers[i], b)


def test_snapshot_is_a_detached_copy_unaffected_by_later_updates():
    net = _net()
    flat = FlatModel(net, segment_bytes=256)
    snap = flat.snapshot()
    assert sorted(snap) == list(range(len(flat.buffers)))
    partial = flat.snapshot([1])
    assert sorted(partial) == [1]
    copies = {i: t.clone() for i, t in snap.items()}
    for i in range(len(flat.buffers)):
        assert snap[i].data_ptr() != flat.buffers[i].data_ptr()
        assert not snap[i].requires_grad
        flat.load_segment(i, torch.full_like(flat.buffers[i], 7.0))
    for i, t in snap.items():
        assert torch.equal(t, copies[i])
    assert not torch.equal(partial[1], flat.buffers[1])


def test_load_segment_and_checksum_track_model_content():
    a, b = FlatModel(_net(0)), FlatModel(_net(1))
    assert a.checksum() != b.checksum()
    for i, buf in enumerate(b.buffers):
        a.load_segment(i, buf)
    assert a.checksum() == b.checksum()
    assert torch.equal(a.buffers[0], b.buffers[0])


def test_holding_runs_the_module_on_other_values_and_gives_its_own_back_bit_for_bit():
    """How a site evaluates the shared model of its last outer step in place of its own."""
    net, other = _net(0).eval(), _net(1).eval()  # eval: batch norm keeps its running stats
    flat, theirs = FlatModel(net, segment_bytes=256), FlatModel(other, segment_bytes=256)
    x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    own_out, own_sum, version = net(x).detach(), flat.checksum(), flat.version
    with flat.holding(dict(enumerate(theirs.buffers))):
        assert torch.equal(net(x), other(x))  # the module's own parameters see the values
        assert flat.version > version  # a multi-rank site sends its ranks what it evaluates
    assert flat.checksum() == own_sum and torch.equal(net(x), own_out)
    with pytest.raises(RuntimeError), flat.holding({1: torch.zeros_like(flat.buffers[1])}):
        raise RuntimeError("an evaluation that fails")
    assert flat.checksum() == own_sum  # given back however the block ends
