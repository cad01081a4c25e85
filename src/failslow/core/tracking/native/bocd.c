/* One update of the truncated run-length posterior of failslow.core.tracking.bocd
 * (Adams & MacKay 2007, as greyhound 4.2 uses it): the arithmetic of the numpy path of
 * RunLengthPosterior.update, in one pass per array instead of ~25 numpy operations (each
 * ~1 us of dispatch on 257 elements). Plain C, no Python.h: loaded with ctypes.
 *
 * n slots j = 0..n-1 (a run holding j observations). mu and beta are updated in place; w is
 * the posterior before, out the posterior after (out[0] = 0); lik is scratch of n doubles.
 */
#include <math.h>

__attribute__((visibility("default"))) void failslow_bocd_update(
    int n, double y, int first, double hazard, double beta0, const double *log_c,
    const double *half_nu1, const double *inv_nu_sf, const double *step, const double *shrink,
    double *mu, double *beta, const double *w, double *out, double *lik) {
    double top = -INFINITY;
    for (int j = 0; j < n; j++) { /* log Student-t predictive of y under every run */
        double dev = y - mu[j];
        double pred = (log_c[j] - 0.5 * log(beta[j])) -
                      half_nu1[j] * log1p(dev * dev * inv_nu_sf[j] / beta[j]);
        lik[j] = pred;
        if (pred > top) top = pred;
    }
    for (int j = 0; j < n; j++) lik[j] = exp(lik[j] - top);
    out[0] = 0.0;
    if (first) {
        for (int j = 1; j < n; j++) out[j] = 0.0;
        out[1] = 1.0;
    } else {
        double keep = 1.0 - hazard, sum;
        for (int j = 2; j < n; j++) out[j] = w[j - 1] * lik[j - 1];
        out[n - 1] += w[n - 1] * lik[n - 1];
        for (int j = 2; j < n; j++) out[j] *= keep;
        out[1] = hazard * lik[0];
        sum = 0.0;
        for (int j = 0; j < n; j++) sum += out[j];
        for (int j = 0; j < n; j++) {
            out[j] /= sum;
            if (out[j] < 1e-300) out[j] = 1e-300; /* keep every run alive */
        }
        out[0] = 0.0;
    }
    /* sufficient statistics: slot j <- slot j - 1 updated with y, from the top down */
    for (int j = n - 1; j >= 1; j--) {
        double dev = y - mu[j - 1];
        mu[j] = mu[j - 1] + dev * step[j - 1];
        beta[j] = beta[j - 1] + shrink[j - 1] * (dev * dev);
    }
    beta[0] = beta0;
}
