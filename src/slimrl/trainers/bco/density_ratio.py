"""The density-ratio classifier of BCO's underlying distribution matching (UDM), as pure tensor math.

UDM (Jung et al. 2024, section 4) reweights thumbs-down examples so that their prompts look distributed like the
thumbs-up ones: a logistic regression told to separate thumbs-up prompt embeddings (class 1) from thumbs-down ones
(class 0), with balanced class weights, estimates p(desirable | x) as if both classes were equally frequent, so its
odds p / (1 - p) estimate the density ratio p_desirable(x) / p_undesirable(x). Each thumbs-down row's loss is scaled by
that ratio clamped to [min_density_ratio, max_density_ratio]; thumbs-up rows keep weight 1.

TRL 0.2x fit scikit-learn's LogisticRegression(class_weight="balanced") (its defaults: an L2 penalty with C = 1 on
the weights, none on the intercept). The same optimum is found here with Newton's method in float64 on the CPU:
deterministic, and without a new dependency. With n rows, n_c of them in row i's class, it minimises

    f(w, b) = sum_i  n / (2 n_c) * log(1 + exp(-s_i (w . x_i + b)))  +  ||w||^2 / 2,    s_i = +1 thumbs-up, -1 down,

which is strictly convex when both classes are present, so Newton's method with a backtracking line search reaches
its one minimum in a handful of steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

RATIO_EPS = 1e-8  # TRL 0.2x's guard in p / (1 - p + eps), kept so the clamped weights match its
MAX_NEWTON_STEPS = 100
GRAD_TOL = 1e-9  # the fit stops when every gradient entry is below this times n times the largest feature magnitude


class ClassifierFitError(ValueError):
    """The density-ratio classifier could not be fit to the given embeddings."""


@dataclass(frozen=True)
class DensityRatioClassifier:
    """A fitted logistic regression: p(desirable | x) = sigmoid(weight . x + bias)."""

    weight: torch.Tensor  # [d] float64
    bias: float

    def prob_desirable(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[n] float64: the probability that each embedding [n, d] is a thumbs-up prompt."""
        return torch.sigmoid(embeddings.detach().to("cpu", torch.float64) @ self.weight + self.bias)

    def accuracy(self, embeddings: torch.Tensor, desirable: bool) -> float:
        """The share of `embeddings` classified as their class (scikit-learn's `score`, as TRL 0.2x logged it)."""
        predicted = self.prob_desirable(embeddings) > 0.5
        return (predicted == desirable).double().mean().item() if len(predicted) else float("nan")


def udm_weights(prob_desirable: torch.Tensor, desirable: torch.Tensor, min_ratio: float,
                max_ratio: float) -> torch.Tensor:  # fmt: skip
    """[n] each row's loss weight: 1 for a thumbs-up row; for a thumbs-down one the estimated density ratio
    p / (1 - p) clamped to [min_ratio, max_ratio] (TRL 0.2x weighted only the thumbs-down side)."""
    prob = prob_desirable.double()
    ratio = (prob / (1 - prob + RATIO_EPS)).clamp(min=min_ratio, max=max_ratio)
    return torch.where(desirable.to(ratio.device).bool(), torch.ones_like(ratio), ratio)


def fit_density_ratio_classifier(embeddings: torch.Tensor, desirable: torch.Tensor) -> DensityRatioClassifier:
    """Fit the balanced, L2-penalised logistic regression to `embeddings` [n, d] labelled `desirable` [n] bool."""
    x = embeddings.detach().to("cpu", torch.float64)
    y = desirable.detach().to("cpu", torch.float64).reshape(-1)
    if x.dim() != 2 or x.size(0) != y.numel():
        raise ClassifierFitError(f"the classifier needs one [n, d] embedding per label; got embeddings of shape "
                                 f"{tuple(x.shape)} for {y.numel()} labels")  # fmt: skip
    n, num_desirable = y.numel(), int(y.sum().item())
    if num_desirable in (0, n):
        raise ClassifierFitError(f"it needs thumbs-up and thumbs-down prompts; got {num_desirable} thumbs-up and "
                                 f"{n - num_desirable} thumbs-down")  # fmt: skip
    if not torch.isfinite(x).all():
        raise ClassifierFitError("some prompt embeddings are not finite (nan or inf)")
    # class_weight="balanced": n / (2 * rows of the class), so each class weighs n / 2 in total
    sample_weight = torch.where(y > 0, n / (2 * num_desirable), n / (2 * (n - num_desirable)))
    basis = None
    if x.size(1) > n:
        # the penalised optimum's w lies in the span of the rows (its gradient is X^T r + w): fitting in an
        # orthonormal basis of that span gives the same w and probabilities with a Hessian of n + 1 rows, not d + 1
        basis = torch.linalg.svd(x, full_matrices=False).Vh.mT  # [d, n]
        x = x @ basis
    theta = _newton(x, y, sample_weight)
    weight = theta[:-1] if basis is None else basis @ theta[:-1]
    return DensityRatioClassifier(weight=weight, bias=theta[-1].item())


def _newton(x: torch.Tensor, y: torch.Tensor, sample_weight: torch.Tensor) -> torch.Tensor:
    """(w, b) minimising the module docstring's f, by damped Newton steps; x [n, k], y [n] in {0, 1}."""
    n = x.size(0)
    design = torch.cat([x, x.new_ones(n, 1)], dim=1)  # [n, k + 1]: the intercept's column last
    penalty = x.new_ones(design.size(1))
    penalty[-1] = 0.0  # scikit-learn leaves the intercept unpenalised
    tolerance = GRAD_TOL * n * max(1.0, x.abs().max().item())

    def objective(theta: torch.Tensor) -> torch.Tensor:
        z = design @ theta
        return (sample_weight * (F.softplus(z) - y * z)).sum() + 0.5 * (penalty * theta**2).sum()

    theta = x.new_zeros(design.size(1))
    for _ in range(MAX_NEWTON_STEPS):
        p = torch.sigmoid(design @ theta)
        grad = design.T @ (sample_weight * (p - y)) + penalty * theta
        if grad.abs().max().item() <= tolerance:
            return theta
        curvature = sample_weight * p * (1 - p)
        hessian = design.T @ (design * curvature[:, None]) + torch.diag(penalty)
        try:
            step = torch.linalg.solve(hessian, grad)
        except RuntimeError as error:  # a singular Hessian: features too large for float64's sigmoid
            raise ClassifierFitError(f"its Hessian is singular ({error})") from error
        theta = _backtrack(objective, theta, step, grad)
    largest = grad.abs().max().item()
    raise ClassifierFitError(f"Newton's method did not converge in {MAX_NEWTON_STEPS} steps (largest gradient entry "
                             f"{largest:.3g}); rescale the prompt embeddings, e.g. normalise them")  # fmt: skip


def _backtrack(objective, theta: torch.Tensor, step: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """theta - t * step for the largest t in 1, 1/2, 1/4, ... that decreases the objective enough (Armijo's rule)."""
    current, slope, t = objective(theta), (grad * step).sum(), 1.0
    for _ in range(60):
        candidate = theta - t * step
        if objective(candidate) <= current - 1e-4 * t * slope:
            return candidate
        t /= 2
    return theta - t * step  # a vanishing step: the gradient test or the step budget ends the fit
