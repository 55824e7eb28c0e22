"""diffusers' `UniPCMultistepScheduler` for flow-matching models, as Wan's published folders ship it.

UniPC (Zhao et al. 2023, arXiv:2302.04867) is a multistep predictor-corrector solver: each step
converts the model's velocity to a data prediction `x0 = x - sigma v`, corrects the sample the
last step predicted with that new prediction (UniC), then predicts the next sample from the last
`order` predictions (UniP). This module computes what diffusers 0.42.1's
`schedulers/scheduling_unipc_multistep.py` computes for `prediction_type="flow_prediction"`,
`use_flow_sigmas=True`, `predict_x0=True` (Wan2.1 / Wan2.2 `scheduler/scheduler_config.json`:
solver_order 2, bh2, lower_order_final, final sigma 0, `flow_shift` 3.0 at 480p, 5.0 at 720p).

`UniPCConfig.from_dict(raw, where)` reads a config: the fields that shape the result are
implemented (num_train_timesteps, flow_shift, solver_order, solver_type bh1/bh2,
lower_order_final, disable_corrector, final_sigmas_type, dynamic shifting with `mu`,
shift_terminal); fields that do nothing with flow sigmas (the beta schedule, timestep_spacing,
steps_offset, the thresholding ratios, sigma_min/max) are checked and accepted; every option
that would change the result and is not implemented (Karras / exponential / beta sigmas,
thresholding, other prediction types, noise-prediction updates, solver_p) is a ValueError
naming the field, as are the combinations whose last step diffusers computes as inf or NaN.

Set-up is host-side numpy: the sigmas in float64 then float32 as `set_timesteps`, and per step
the coefficients (h, B(h), the rks and the rhos from `R rho = b`) in float32 as the torch code
computes them. The update is one jitted function whose coefficients are runtime arrays of fixed
shape (unused history slots have weight 0), so every step of every schedule runs the same
compiled program for a given sample shape and dtype. It computes in float32 (the sample and
velocity upcast) and returns the sample's dtype, as diffusers does for float32 latents; for
bfloat16 velocities diffusers rounds `sigma * v` to bfloat16 first, this port does not.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from difflet_tpu.pipeline import schedules as S

# diffusers 0.42.1's __init__ defaults: a field a config leaves out takes these
DEFAULTS = dict(
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None,
    solver_order=2, prediction_type="epsilon", thresholding=False, dynamic_thresholding_ratio=0.995,
    sample_max_value=1.0, predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[],
    solver_p=None, use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
    use_flow_sigmas=False, flow_shift=1.0, timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero",
    rescale_betas_zero_snr=False, use_dynamic_shifting=False, time_shift_type="exponential", sigma_min=None,
    sigma_max=None, shift_terminal=None,
)
# options this port does not implement: field -> the only value accepted
REQUIRED = dict(prediction_type="flow_prediction", use_flow_sigmas=True, predict_x0=True, thresholding=False,
                solver_p=None, use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False)
# diffusers maps these solver types to bh2 (UniPCMultistepScheduler.__init__)
SOLVER_TYPES = {"bh1": "bh1", "bh2": "bh2", "midpoint": "bh2", "heun": "bh2", "logrho": "bh2"}


@dataclasses.dataclass(frozen=True)
class UniPCConfig:
    """The UniPCMultistepScheduler fields that shape a flow-matching run (defaults: Wan2.1 480p)."""

    num_train_timesteps: int = 1000
    flow_shift: float = 3.0
    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple = ()
    final_sigmas_type: str = "zero"
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str = "scheduler_config.json") -> "UniPCConfig":
        """A `scheduler_config.json`'s dict, checked; errors are ValueErrors naming `where` and the field."""
        unknown = sorted(k for k in raw if not k.startswith("_") and k not in DEFAULTS)
        if unknown:
            raise ValueError(f"{where}: unknown UniPCMultistepScheduler fields {unknown} (diffusers 0.42.1 has none "
                             f"of these; refused rather than ignored)")
        c = {**DEFAULTS, **{k: v for k, v in raw.items() if not k.startswith("_")}}
        for k, want in REQUIRED.items():
            if c[k] != want:
                raise ValueError(f"{where}: {k}={c[k]!r} is not implemented by this port's UniPC "
                                 f"(it runs {k}={want!r}, the flow-matching data-prediction solver)")
        get = S.ConfigField(c, where)
        solver_type = get.choice("solver_type", tuple(SOLVER_TYPES))
        cfg = cls(
            num_train_timesteps=get.int("num_train_timesteps", minimum=1),
            flow_shift=get.number("flow_shift", positive=True),
            solver_order=get.int("solver_order", minimum=1),
            solver_type=SOLVER_TYPES[solver_type],
            lower_order_final=get.bool("lower_order_final"),
            disable_corrector=get.int_list("disable_corrector"),
            final_sigmas_type=get.choice("final_sigmas_type", ("zero", "sigma_min")),
            use_dynamic_shifting=get.bool("use_dynamic_shifting"),
            time_shift_type=get.choice("time_shift_type", ("exponential", "linear")),
            shift_terminal=get.number("shift_terminal", optional=True),
        )
        # checked, no effect with flow sigmas (diffusers uses them for the VP sigmas, add_noise, thresholding)
        get.choice("beta_schedule", ("linear", "scaled_linear", "squaredcos_cap_v2"))
        get.choice("timestep_spacing", ("linspace", "leading", "trailing"))
        get.int("steps_offset", minimum=0)
        get.bool("rescale_betas_zero_snr")
        for k in ("beta_start", "beta_end", "dynamic_thresholding_ratio", "sample_max_value"):
            get.number(k)
        for k in ("sigma_min", "sigma_max"):
            get.number(k, optional=True)
        if c["trained_betas"] is not None and not isinstance(c["trained_betas"], list):
            raise ValueError(f"{where}: trained_betas must be a list of numbers or null, got {c['trained_betas']!r}")
        if cfg.shift_terminal is not None and not 0 <= cfg.shift_terminal < 1:
            raise ValueError(f"{where}: shift_terminal must be in [0, 1), got {cfg.shift_terminal!r}")
        cfg.check(where)
        return cfg

    def check(self, where: str = "UniPCConfig") -> None:
        """Combinations whose last step diffusers computes as inf or NaN."""
        if not self.lower_order_final and self.solver_order > 1:
            raise ValueError(f"{where}: lower_order_final=False with solver_order {self.solver_order}: diffusers' last "
                             f"step is of order > 1 over a step h that is infinite (final sigma 0) or 0 (sigma_min), "
                             f"and its latents are inf or NaN; use lower_order_final=True")
        if self.final_sigmas_type == "zero" and self.solver_type == "bh1":
            raise ValueError(f"{where}: solver_type='bh1' with final_sigmas_type='zero': diffusers' last step "
                             f"computes B(h) = -inf times 0 (NaN latents); use bh2 or final_sigmas_type='sigma_min'")


# --------------------------------------------------------------------------
# Set-up (host, numpy)
# --------------------------------------------------------------------------


def set_timesteps(cfg: UniPCConfig, num_inference_steps: int | None = None, *, sigmas=None,
                  mu: float | None = None) -> S.Schedule:
    """`UniPCMultistepScheduler.set_timesteps` with flow sigmas: sigmas linspace(1, 1/T, N + 1)[:-1]
    (or given), shifted statically by flow_shift (or by `mu`), optionally stretched to shift_terminal,
    the first nudged below 1; timesteps = int(sigma T) (diffusers' int64, here float32)."""
    if cfg.use_dynamic_shifting and mu is None:
        raise ValueError("`mu` must be passed when `use_dynamic_shifting` is set to be `True`")
    n = cfg.num_train_timesteps
    if sigmas is not None:
        s = np.array(sigmas, np.float64)
        if s.ndim != 1 or len(s) < 1 or not np.isfinite(s).all():
            raise ValueError(f"sigmas must be a 1-D list of finite numbers, got {np.asarray(sigmas).tolist()}")
    else:
        if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, (int, np.integer)) \
                or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be an int >= 1, got {num_inference_steps!r}")
        s = np.linspace(1, 1 / n, num_inference_steps + 1)[:-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        if cfg.use_dynamic_shifting:
            e = math.exp(mu) if cfg.time_shift_type == "exponential" else mu
            s = e / (e + (1 / s - 1) ** 1.0)
        else:
            s = cfg.flow_shift * s / (1 + (cfg.flow_shift - 1) * s)
        if cfg.shift_terminal:
            one_minus = 1 - s
            s = 1 - one_minus / (one_minus[-1] / (1 - cfg.shift_terminal))
    s = np.array(s, np.float64)
    if np.fabs(s[0] - 1) < 1e-6:  # diffusers: lambda(1) = log(0) would be -inf
        s[0] -= 1e-6
    timesteps = (s * n).astype(np.int64).astype(np.float32)
    last = s[-1] if cfg.final_sigmas_type == "sigma_min" else 0
    return S.Schedule(timesteps=timesteps, sigmas=np.concatenate([s, [last]]).astype(np.float32))


def _lambda(sigma: np.float32) -> np.float32:
    """log(alpha) - log(sigma) with flow sigmas (alpha = 1 - sigma), in float32; inf at sigma 0."""
    with np.errstate(divide="ignore"):
        return np.log(np.float32(1) - sigma) - np.log(sigma)


def _bh_coefficients(cfg: UniPCConfig, sigmas: np.ndarray, t: int, s0: int, previous: list, order: int):
    """diffusers' multistep_uni_{p,c}_bh_update set-up from sigma index `s0` to `t` with the earlier
    predictions at sigma indices `previous` (most recent first): (sigma_t / sigma_s0,
    alpha_t h_phi_1, alpha_t B(h), rks [order - 1], R, b), float32."""
    f32 = np.float32
    with np.errstate(divide="ignore", invalid="ignore"):
        sigma_t, sigma_s0 = f32(sigmas[t]), f32(sigmas[s0])
        alpha_t = f32(1) - sigma_t
        lambda_s0 = _lambda(sigma_s0)
        h = _lambda(sigma_t) - lambda_s0
        rks = [(_lambda(f32(sigmas[si])) - lambda_s0) / h for si in previous[:order - 1]] + [f32(1)]
        rks = np.array(rks, f32)
        hh = -h  # predict_x0
        h_phi_1 = np.expm1(hh)
        h_phi_k = h_phi_1 / hh - f32(1)
        factorial_i = 1
        B_h = hh if cfg.solver_type == "bh1" else np.expm1(hh)
        R, b = [], []
        for i in range(1, order + 1):
            R.append(rks ** (i - 1))
            b.append(h_phi_k * f32(factorial_i) / B_h)
            factorial_i *= i + 1
            h_phi_k = h_phi_k / hh - f32(1 / factorial_i)
        return (f32(sigma_t / sigma_s0), f32(alpha_t * h_phi_1), f32(alpha_t * B_h), rks[:-1],
                np.array(R, f32), np.array(b, f32))


def _padded(values, k: int, fill: float) -> np.ndarray:
    out = np.full((k,), fill, np.float32)
    out[:len(values)] = values
    return out


def step_coefficients(cfg: UniPCConfig, sigmas: np.ndarray, state: "UniPCState", i: int) -> tuple[dict, int]:
    """The runtime coefficients of step `i` from `state` (UniPCMultistepScheduler.step's corrector
    and predictor set-up), and the predictor's order (the next corrector's)."""
    K = cfg.solver_order
    slots = max(K - 1, 1)  # history slots beyond the newest (a zero-weight one when K == 1)
    c = dict(sigma=np.float32(sigmas[i]), use_corrector=np.bool_(False))
    # the corrector: from sigma i-1 to i with the previous predictor's order
    use = state.last_sample is not None and (i - 1) not in cfg.disable_corrector
    c["use_corrector"] = np.bool_(use)
    if use:
        p = state.this_order
        ratio, ah, ab, rks, R, b = _bh_coefficients(cfg, sigmas, i, i - 1, [i - 1 - k for k in range(1, K)], p)
        rhos = np.array([0.5], np.float32) if p == 1 else np.linalg.solve(R, b).astype(np.float32)
        c.update(c_ratio=ratio, c_ah=ah, c_ab=ab, c_rks=_padded(rks, slots, 1.0), c_rhos=_padded(rhos[:-1], slots, 0.0),
                 c_rho_t=np.float32(rhos[-1]))
    else:
        c.update(c_ratio=np.float32(0), c_ah=np.float32(0), c_ab=np.float32(0), c_rks=np.ones(slots, np.float32),
                 c_rhos=np.zeros(slots, np.float32), c_rho_t=np.float32(0))
    # the predictor: from sigma i to i+1
    n = len(sigmas) - 1
    order = min(K, n - i) if cfg.lower_order_final else K
    order = min(order, state.lower_order_nums + 1)
    ratio, ah, ab, rks, R, b = _bh_coefficients(cfg, sigmas, i + 1, i, [i - k for k in range(1, K)], order)
    if order == 1:
        rhos = np.zeros(0, np.float32)
    elif order == 2:
        rhos = np.array([0.5], np.float32)
    else:
        rhos = np.linalg.solve(R[:-1, :-1], b[:-1]).astype(np.float32)
    c.update(p_ratio=ratio, p_ah=ah, p_ab=ab, p_rks=_padded(rks, slots, 1.0), p_rhos=_padded(rhos, slots, 0.0))
    return c, order


# --------------------------------------------------------------------------
# The update (device, one jitted program)
# --------------------------------------------------------------------------


@functools.cache
def _jitted():
    import jax
    import jax.numpy as jnp

    def weighted(history, m0, rks, rhos):
        # einsum("k,bkc...->bc...", rhos, D1s) with D1s[k] = (m_k - m0) / rk_k
        res = 0.0
        for k, m in enumerate(history):
            res = res + rhos[k] * ((m - m0) / rks[k])
        return res

    @jax.jit
    def update(sample, model_output, last_sample, history, c):
        """UniPCMultistepScheduler.step for one step: returns (prev_sample, the (corrected) sample
        as the next step's last_sample, the history with this step's x0 prediction first)."""
        f32 = jnp.float32
        x = sample.astype(f32)
        x0 = x - c["sigma"] * model_output.astype(f32)  # convert_model_output, flow_prediction
        # UniC: correct the last prediction with this step's x0
        m0 = history[0]
        res = weighted(history[1:], m0, c["c_rks"], c["c_rhos"])
        corrected = (c["c_ratio"] * last_sample.astype(f32) - c["c_ah"] * m0
                     - c["c_ab"] * (res + c["c_rho_t"] * (x0 - m0)))
        x = jnp.where(c["use_corrector"], corrected.astype(sample.dtype).astype(f32), x)
        history = (x0,) + tuple(history[:-1])
        # UniP: predict the next sample
        res = weighted(history[1:], x0, c["p_rks"], c["p_rhos"])
        prev = c["p_ratio"] * x - c["p_ah"] * x0 - c["p_ab"] * res
        return prev.astype(sample.dtype), x.astype(sample.dtype), history

    # keep_unused: the zeros are made where `sample` lives (as the update's outputs are), so
    # the first step and the later ones run the same program
    @functools.partial(jax.jit, static_argnums=1, keep_unused=True)
    def fresh(sample, k):
        """A first step's placeholders: last_sample and k history slots (weight 0 until filled)."""
        zero = jnp.zeros(sample.shape, jnp.float32)
        return zero.astype(sample.dtype), tuple(zero for _ in range(k))

    return update, fresh


@dataclasses.dataclass
class UniPCState:
    """The solver's memory between steps (diffusers keeps it on the scheduler): the step it takes
    next, its warm-up counter, the last predictor's order (the next corrector's), the sample the
    last predictor started from (None before the first step: no corrector) and the x0
    predictions, most recent first (float32, `solver_order` slots; zeros until filled)."""

    step_index: int
    lower_order_nums: int = 0
    this_order: int = 1
    last_sample: object = None
    history: tuple = ()


class UniPCSampler:
    """A UniPC run of `num_inference_steps`: `.timesteps` [N] float32 (what the transformer gets),
    `.sigmas` [N + 1], `step(i, model_output, sample) -> sample`. Steps run in order from 0
    (step 0 starts a run); `begin(i)` starts one at step i, as diffusers' `set_begin_index`."""

    def __init__(self, cfg: UniPCConfig, num_inference_steps: int | None = None, *, sigmas=None,
                 mu: float | None = None):
        cfg.check()
        self.config = cfg
        schedule = set_timesteps(cfg, num_inference_steps, sigmas=sigmas, mu=mu)
        self.timesteps, self.sigmas = schedule.timesteps, schedule.sigmas
        self.state: UniPCState | None = None

    def __len__(self) -> int:
        return len(self.timesteps)

    def begin(self, i: int = 0) -> None:
        if not 0 <= i < len(self):
            raise ValueError(f"step {i} is outside this {len(self)}-step schedule")
        self.state = UniPCState(step_index=i)

    def step(self, i: int, model_output, sample):
        """One UniPCMultistepScheduler.step: the (corrected) sample at sigma_i -> the sample at sigma_{i+1}."""
        if i == 0 or self.state is None:
            self.begin(i)
        if i != self.state.step_index:
            raise ValueError(f"UniPC steps run in order: this run's next step is {self.state.step_index}, got {i} "
                             f"(begin(i) starts a run at step i)")
        if np.shape(model_output) != np.shape(sample):
            raise ValueError(f"model_output {np.shape(model_output)} and sample {np.shape(sample)} differ in shape")
        update, fresh = _jitted()
        st = self.state
        last, history = st.last_sample, st.history
        if last is None:
            last, history = fresh(sample, self.config.solver_order)
        c, order = step_coefficients(self.config, self.sigmas, st, i)
        prev, last, history = update(sample, model_output, last, history, c)
        lower = min(st.lower_order_nums + 1, self.config.solver_order)
        self.state = UniPCState(step_index=i + 1, lower_order_nums=lower, this_order=order, last_sample=last,
                                history=history)
        return prev
