"""Helpers for GPU correctness tests: poisoned allocations and error metrics."""
import torch


def poison_allocator(nbytes: int, device="cuda", count: int = 8) -> None:
    """Fill freed caching-allocator blocks of about `nbytes` with NaN, so an output that the
    kernel forgets to write shows up as NaN instead of stale zeros."""
    blocks = [torch.full((max(1, nbytes // 4),), float("nan"), device=device) for _ in range(count)]
    del blocks


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, rel_tol, abs_tol, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output or NaN)"
    err = rel_error(out, ref)
    max_abs = (out.double() - ref.double()).abs().max().item()
    assert err < rel_tol, f"{what}: relative error {err:.2e} >= {rel_tol:.0e} (max abs {max_abs:.2e})"
    assert max_abs < abs_tol, f"{what}: max abs error {max_abs:.2e} >= {abs_tol:.0e} (rel {err:.2e})"
