"""The pointwise ops beyond pointwise.py's lists, by family, from one table.

Every op here is elementwise with broadcasting: any output dim may be split, on every input
that carries it (``shard_strategies``). A family names ATen packets; each packet's functional
overloads that take and return tensors are registered (``int``/``float``/``Scalar``-only
overloads are Python-number math, and ``out=`` forms are never traced). A family that is
linear in its operands keeps partial sums partial (pointwise.py's rules), the others are plain
elementwise. Overloads pointwise.py already lists keep their rule there.

Example:
    >>> get_rule(aten.hypot.default).__name__
    'elementwise_rule'
"""

from __future__ import annotations

import torch

from autopar.sharding.rules.pointwise import (
    additive_rule,
    elementwise_rule,
    multiplicative_rule,
    unary_linear_rule,
)
from autopar.sharding.rules.registry import OpInfo, Strategy, get_rule, register

aten = torch.ops.aten

# family -> (rule, ATen packets)
FAMILIES = {
    "unary math": (
        elementwise_rule,
        "acosh asinh atanh arccos arcsin arctan arccosh arcsinh arctanh sinc erfc lgamma digamma polygamma "
        "mvlgamma i0 angle signbit isneginf isposinf isreal fix absolute sgn frac trunc exp2 expm1 logit "
        "erfinv square reciprocal sigmoid softplus log_sigmoid_forward hardtanh silu mish elu selu celu "
        "threshold nan_to_num tanh sign sin cos tan sinh cosh asin acos atan log log2 log10 log1p exp sqrt "
        "rsqrt abs ceil floor round neg_ clip",
    ),
    "binary math": (
        elementwise_rule,
        "hypot copysign fmax fmin fmod remainder float_power ldexp logaddexp logaddexp2 nextafter heaviside "
        "xlogy igamma igammac gcd lcm bitwise_left_shift bitwise_right_shift atan2 arctan2 maximum minimum "
        "pow lerp",
    ),
    "ternary math": (elementwise_rule, "addcmul addcdiv"),
    "special functions": (
        elementwise_rule,
        "special_i0e special_i1 special_i1e special_entr special_erfcx special_ndtr special_ndtri "
        "special_log_ndtr special_xlog1py special_zeta special_bessel_j0 special_bessel_j1 special_polygamma "
        "special_expit special_exp2 special_expm1 special_logit special_round special_sinc special_psi "
        "special_digamma special_gammaln special_erf special_erfc special_erfinv special_log1p "
        "special_multigammaln special_chebyshev_polynomial_t special_chebyshev_polynomial_u "
        "special_hermite_polynomial_h special_hermite_polynomial_he special_laguerre_polynomial_l "
        "special_legendre_polynomial_p special_modified_bessel_i0 special_modified_bessel_i1 "
        "special_modified_bessel_k0 special_modified_bessel_k1 special_airy_ai "
        "special_scaled_modified_bessel_k0 special_scaled_modified_bessel_k1 special_spherical_bessel_j0",
    ),
    "complex numbers": (
        elementwise_rule,
        "complex polar real imag conj_physical conj _conj resolve_conj resolve_neg chalf",
    ),
    # linear: a partial sum stays partial
    "linear unary": (unary_linear_rule, "positive negative deg2rad rad2deg"),
    "additive": (additive_rule, "rsub"),
    "multiplicative": (multiplicative_rule, "true_divide"),
}


def _tensor_overloads(packet_name: str) -> list:
    """The packet's overloads that take a tensor and return one (no ``out=`` forms)."""
    packet = getattr(aten, packet_name, None)
    if packet is None:
        return []
    out = []
    for name in packet.overloads():
        op = getattr(packet, name)
        schema = op._schema
        if "out" in name or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            continue
        takes = any(str(a.type).startswith("Tensor") for a in schema.arguments)
        gives = len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
        if takes and gives:
            out.append(op)
    return out


def _register_families() -> None:
    for rule, packets in FAMILIES.values():
        ops = [op for name in packets.split() for op in _tensor_overloads(name) if get_rule(op) is None]
        register(*dict.fromkeys(ops))(rule)


_register_families()


@register(aten.frexp.Tensor)
def elementwise_pair_rule(op: OpInfo) -> list[Strategy]:
    """An elementwise op with two outputs of the input's shape (frexp: mantissa, exponent)."""
    return [Strategy(s.inputs, s.outputs * len(op.outputs), None, s.note) for s in elementwise_rule(op)]
