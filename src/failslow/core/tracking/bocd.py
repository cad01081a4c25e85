"""Bayesian online change-point detection (Adams & MacKay 2007), as used in greyhound 4.2.

The model: iteration times are split into runs; within a run the *log* iteration time is
Normal with unknown mean and variance (conjugate Normal-Gamma prior, Student-t predictive); a
new run starts after any iteration with constant hazard ``H``. The posterior over the current
run length ``r_t`` is updated once per iteration.

Two practical choices, both standard:
- Run length ``r_t = 0`` means "x_t is the first point of a new run", so the new-run branch is
  scored with the prior predictive. (Scoring it with the old run's predictive makes
  ``P(r_t = 0) = H`` for every ``t``, useless for reporting.)
- The posterior is truncated to ``max_run`` run lengths: runs longer than that share the last
  slot, whose statistics are those of the newest ``max_run`` points (a sliding window, which
  also lets slow drift be forgotten). Each update is O(max_run), vectorised in numpy.

Because a run's observation count is its run length, ``kappa`` and ``alpha`` depend only on the
slot and are precomputed with the Student-t normalising constants; only ``mu`` and ``beta`` move.

An update runs in C when the package's native kernel was built (:mod:`.native`: the same
arithmetic in one pass per array: 17 us against 45 us for ~25 numpy operations on 257 slots,
which made BOCD the largest part of a detector update); otherwise in numpy. The two agree to a
few ulps.
"""

from __future__ import annotations

import numpy as np
from scipy.special import gammaln

from failslow.core.tracking.native import bocd_update
from failslow.core.tracking.native import status as native_status


class RunLengthPosterior:
    """Online BOCD over a scalar series (here: log iteration time)."""

    def __init__(
        self,
        *,
        hazard: float = 1.0 / 250.0,
        max_run: int = 256,
        prior_scale: float = 0.1,
        kappa0: float = 1.0,
        alpha0: float = 1.0,
        native: bool | None = None,
    ) -> None:
        """``native``: run updates in the C kernel (None: when it was built; True: it must
        have been)."""
        if not 0.0 < hazard < 1.0:
            raise ValueError(f"hazard must be in (0, 1), got {hazard!r}")
        if max_run < 2:
            raise ValueError(f"max_run must be at least 2, got {max_run!r}")
        if prior_scale <= 0 or kappa0 <= 0 or alpha0 <= 0:
            raise ValueError("prior_scale, kappa0 and alpha0 must be positive")
        self.max_run = max_run
        j = np.arange(max_run + 1, dtype=np.float64)  # slot j: a run holding j observations
        self._kappa = kappa0 + j
        alpha = alpha0 + j / 2.0
        self._nu = 2.0 * alpha
        # predictive scale^2 = beta * (kappa + 1) / (alpha * kappa)
        self._scale_factor = (self._kappa + 1.0) / (alpha * self._kappa)
        nu = self._nu
        self._log_c = gammaln((nu + 1.0) / 2.0) - gammaln(nu / 2.0) - 0.5 * np.log(nu * np.pi)
        self._half_nu1 = (self._nu + 1.0) / 2.0
        self._log_c -= 0.5 * np.log(self._scale_factor)  # fold the scale factor in
        self._inv_nu_sf = 1.0 / (self._nu * self._scale_factor)
        self._step = 1.0 / (self._kappa[:-1] + 1.0)
        self._shrink = 0.5 * self._kappa[:-1] / (self._kappa[:-1] + 1.0)
        self._hazard = hazard
        self._beta0 = alpha0 * prior_scale**2
        self._mu = np.zeros(max_run + 1)
        self._beta = np.full(max_run + 1, self._beta0)
        self._w = np.zeros(max_run + 1)  # P(run holds j observations | data), j = 0..max_run
        self.t = -1
        kernel = bocd_update() if native is not False else None
        if native and kernel is None:
            raise RuntimeError(f"native=True, but {native_status()[1]}")
        self._kernel = kernel
        if kernel is not None:  # buffers the kernel writes in place, and their addresses
            self._out = np.zeros(max_run + 1)  # the posterior after, swapped with _w
            self._lik = np.empty(max_run + 1)  # scratch
            consts = (self._log_c, self._half_nu1, self._inv_nu_sf, self._step, self._shrink)
            self._args = [a.ctypes.data for a in (*consts, self._mu, self._beta)]
            self._ptr_w, self._ptr_out = self._w.ctypes.data, self._out.ctypes.data
            self._ptr_lik = self._lik.ctypes.data

    @property
    def native(self) -> bool:
        """Whether updates run in the C kernel."""
        return self._kernel is not None

    def update(self, y: float, prior_mean: float | None = None) -> np.ndarray:
        """Absorb one observation; return P(run holds j obs), j = 0..max_run (j = r_t + 1).

        The returned array is the posterior itself, read-only and valid until the next update
        (no copy is made: callers read it at once).
        """
        if self.t < 0:
            self._mu[0] = y if prior_mean is None else prior_mean
        elif prior_mean is not None:
            self._mu[0] = prior_mean
        if self._kernel is not None:
            return self._native_update(y)
        mu, beta = self._mu, self._beta
        dev = y - mu
        dev2 = dev * dev
        # log Student-t predictive of y under every run's posterior
        pred = self._log_c - 0.5 * np.log(beta) - self._half_nu1 * np.log1p(
            dev2 * self._inv_nu_sf / beta
        )
        lik = np.exp(pred - pred.max())
        w = self._w
        new = np.empty_like(w)
        new[0] = 0.0
        if self.t < 0:
            new[1:] = 0.0
            new[1] = 1.0
        else:
            grow = w * lik
            new[2:] = grow[1:-1]
            new[-1] += grow[-1]
            new[2:] *= 1.0 - self._hazard
            new[1] = self._hazard * lik[0]
            new /= new.sum()
            np.maximum(new, 1e-300, out=new)  # keep every run alive (no underflow to 0)
            new[0] = 0.0
        self._w = new
        # sufficient statistics: slot j+1 <- slot j updated with y (last slot: newest window)
        new_mu = np.empty_like(mu)
        new_beta = np.empty_like(beta)
        new_mu[1:] = mu[:-1] + dev[:-1] * self._step
        new_beta[1:] = beta[:-1] + self._shrink * dev2[:-1]
        new_mu[0] = mu[0]
        new_beta[0] = self._beta0
        self._mu, self._beta = new_mu, new_beta
        self.t += 1
        new.flags.writeable = False
        return new

    def _native_update(self, y: float) -> np.ndarray:
        # mu and beta are updated in place; the posterior goes from _w into _out, then the two
        # buffers swap (the one returned is read-only to its callers, written only here)
        n, kernel = self.max_run + 1, self._kernel
        assert kernel is not None
        kernel(
            n, y, self.t < 0, self._hazard, self._beta0, *self._args,
            self._ptr_w, self._ptr_out, self._ptr_lik,
        )  # fmt: skip
        self._w, self._out = self._out, self._w
        self._ptr_w, self._ptr_out = self._ptr_out, self._ptr_w
        self.t += 1
        view = self._w.view()
        view.flags.writeable = False
        return view

    @property
    def probabilities(self) -> np.ndarray:
        """P(run holds j observations | data) for j = 0..max_run (index 0 is always 0)."""
        return self._w.copy()
