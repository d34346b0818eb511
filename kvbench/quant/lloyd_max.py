"""Scalar Lloyd-Max codebooks for the coordinates of a random unit vector, and random rotations.

TurboQuant (Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal Distortion
Rate", 2025) rotates a unit vector ``u`` in R^d by a random orthogonal ``Pi``; each coordinate of
``y = Pi u`` then follows the density of one coordinate of a uniformly random point on the sphere,

    f_d(t) = (1 - t^2)^((d - 3) / 2) / B(1/2, (d - 1) / 2),    t in [-1, 1]

(mean 0, variance exactly 1/d; close to N(0, 1/d) for large d), and is quantized with the scalar
codebook of L levels that minimizes the MSE for f_d (Lloyd-Max). The optimal codebook is a fixed
point of the two Lloyd conditions:

    b_i = (c_i + c_{i+1}) / 2                                   (boundaries: midpoints)
    c_i = int_{b_{i-1}}^{b_i} t f_d(t) dt / int_{b_{i-1}}^{b_i} f_d(t) dt   (centroids: cell means)

with b_0 = -1, b_L = 1. Both integrals are in closed form, so no quadrature is needed:

    int_lo^hi f_d = I_{(hi+1)/2}(a, a) - I_{(lo+1)/2}(a, a),   a = (d - 1) / 2
        (I the regularized incomplete beta function: (t + 1) / 2 ~ Beta(a, a))
    int_lo^hi t f_d = [(1 - lo^2)^a - (1 - hi^2)^a] / ((d - 1) B(1/2, a))
        (d/dt (1 - t^2)^a = -(d - 1) t (1 - t^2)^((d - 3) / 2)).

The iteration starts from the high-resolution (Panter-Dite) point density, proportional to
f_d^(1/3), which is again of this Beta form, and takes Newton steps on c - T(c) = 0 (T the Lloyd map;
its Jacobian is tridiagonal), falling back to a plain Lloyd step whenever a Newton step would not
reduce the residual, so the result is the Lloyd fixed point to ``tol`` in a few dozen steps even at
L = 256, where plain Lloyd iterations need tens of thousands.

For L = 2 the fixed point is c = +-E|t| = +-2 / ((d - 1) B(1/2, a)), which tends to
+-sqrt(2 / (pi d)) as d grows.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from scipy.linalg import solve_banded
from scipy.special import betainc, betaincinv, betaln

from kvbench.quant.levels import check_levels


def _check(levels: int, dim: int) -> None:
    check_levels(levels)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim must be an int >= 2, got {dim!r}")


class _SphereCoordinate:
    """The density f_d above: its cell masses, first moments and density values, in float64."""

    def __init__(self, dim: int):
        self.dim = dim
        self.a = (dim - 1) / 2
        self.log_norm = -betaln(0.5, self.a)  # log of 1 / B(1/2, a)

    def cdf(self, t: np.ndarray) -> np.ndarray:
        return betainc(self.a, self.a, (np.clip(t, -1, 1) + 1) / 2)

    def mass(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """P(lo < t < hi), computed from the nearer tail so that tail cells keep relative precision."""
        upper = lo >= 0  # whole cell in the upper half: use the survival function S(t) = F(-t)
        lower = hi <= 0
        middle = self.cdf(hi) - self.cdf(lo)
        return np.where(lower, middle, np.where(upper, self.cdf(-lo) - self.cdf(-hi), middle))

    def _moment_part(self, t: np.ndarray) -> np.ndarray:
        """(1 - t^2)^a / ((d - 1) B(1/2, a)), whose decrease over [lo, hi] is int_lo^hi t f_d."""
        t = np.clip(t, -1, 1)
        return np.exp(self.log_norm) * (1 - t * t) ** self.a / (self.dim - 1)

    def first_moment(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return self._moment_part(lo) - self._moment_part(hi)

    def density(self, t: np.ndarray) -> np.ndarray:
        t = np.clip(t, -1, 1)
        with np.errstate(divide="ignore"):
            return np.exp(self.log_norm) * (1 - t * t) ** ((self.dim - 3) / 2)

    def panter_dite_start(self, levels: int) -> np.ndarray:
        """Quantiles of the density proportional to f_d^(1/3) ((t+1)/2 ~ Beta(a', a'), a' = (d+3)/6)."""
        a3 = (self.dim - 3) / 6 + 1
        return 2 * betaincinv(a3, a3, (np.arange(levels) + 0.5) / levels) - 1


def _edges(c: np.ndarray) -> np.ndarray:
    return np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])


def _lloyd_map(f: _SphereCoordinate, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(T(c), masses, edges)``: the conditional means of the cells that the midpoints of c define."""
    e = _edges(c)
    p = f.mass(e[:-1], e[1:])
    return f.first_moment(e[:-1], e[1:]) / p, p, e


def _symmetrize(c: np.ndarray) -> np.ndarray:
    return (c - c[::-1]) / 2


def _newton_step(f: _SphereCoordinate, c: np.ndarray, t: np.ndarray, p: np.ndarray, e: np.ndarray):
    """Solve (I - dT/dc) delta = c - T(c); dT/dc is tridiagonal because b_i depends on c_i, c_{i+1}.

    d T_i / d b_i = f(b_i) (b_i - T_i) / p_i,  d T_i / d b_{i-1} = f(b_{i-1}) (T_i - b_{i-1}) / p_i,
    and d b_i / d c_i = d b_i / d c_{i+1} = 1/2 (the outer edges -1, 1 are fixed).
    """
    n = len(c)
    dens = f.density(e)
    up = np.zeros(n)
    down = np.zeros(n)
    up[:-1] = dens[1:-1] * (e[1:-1] - t[:-1]) / p[:-1] / 2  # through b_i (i < L-1)
    down[1:] = dens[1:-1] * (t[1:] - e[1:-1]) / p[1:] / 2  # through b_{i-1} (i > 0)
    band = np.zeros((3, n))
    band[0, 1:] = -up[:-1]  # J[i, i+1] = -dT_i/dc_{i+1}
    band[1] = 1 - up - down  # J[i, i]
    band[2, :-1] = -down[1:]  # J[i+1, i] = -dT_{i+1}/dc_i
    return solve_banded((1, 1), band, c - t)


@functools.lru_cache(maxsize=128)
def lloyd_max_codebook(
    levels: int, dim: int, iters: int = 1000, tol: float = 1e-12
) -> tuple[np.ndarray, np.ndarray]:
    """MSE-optimal scalar codebook of ``levels`` levels for one coordinate of a random unit vector in
    R^``dim`` (the density f_d of the module docstring).

    Args:
        levels: L, 2..256.
        dim: d >= 2.
        iters: most Newton/Lloyd steps; RuntimeError if the fixed point is not reached by then.
        tol: stop when max_i |c_i - T(c)_i| <= tol / sqrt(d) (tol in units of the coordinate's std).

    Returns:
        ``(centroids, boundaries)``: read-only float64 arrays ``[L]`` ascending and ``[L - 1]``
        (the midpoints), symmetric about 0. Cached per ``(levels, dim, iters, tol)``.
    """
    _check(levels, dim)
    f = _SphereCoordinate(dim)
    scale_tol = tol / math.sqrt(dim)
    c = _symmetrize(f.panter_dite_start(levels))
    for _ in range(iters):
        t, p, e = _lloyd_map(f, c)
        t = _symmetrize(t)
        residual = np.abs(c - t).max()
        if residual <= scale_tol:
            break
        step = c - _newton_step(f, c, t, p, e)
        step = _symmetrize(step)
        accepted = False
        if np.all(np.isfinite(step)) and np.all(np.diff(step) > 0) and -1 < step[0] and step[-1] < 1:
            t2 = _symmetrize(_lloyd_map(f, step)[0])
            accepted = np.abs(step - t2).max() < residual
        c = step if accepted else t
    else:
        raise RuntimeError(f"Lloyd-Max for levels={levels}, dim={dim} did not converge in {iters} steps")
    boundaries = (c[1:] + c[:-1]) / 2
    c.setflags(write=False)
    boundaries.setflags(write=False)
    return c, boundaries


def quantize_scalar(y: torch.Tensor, centroids: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Index of the nearest centroid for every element of ``y`` (uint8, same shape).

    The cells are cut at the midpoints of consecutive (ascending) centroids; a value exactly on a
    midpoint goes to the lower cell.
    """
    c = torch.as_tensor(np.asarray(centroids) if isinstance(centroids, np.ndarray) else centroids)
    c = c.to(device=y.device, dtype=torch.float32)
    boundaries = (c[1:] + c[:-1]) / 2
    return torch.bucketize(y.float().contiguous(), boundaries).to(torch.uint8)


@functools.lru_cache(maxsize=1024)
def _haar_orthogonal(dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    # Q's columns times sign(diag R) makes the factorization unique, hence Q Haar-distributed.
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return q * signs


def random_rotation(
    dim: int, seed: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A Haar-random orthogonal ``[dim, dim]`` matrix, a deterministic function of ``seed``: QR of a
    standard Gaussian matrix drawn on the CPU from ``torch.Generator().manual_seed(seed)`` (float64),
    with the signs of R's diagonal moved into Q; then cast to ``dtype`` on ``device``."""
    return _haar_orthogonal(dim, seed).to(device=device, dtype=dtype, copy=True)
