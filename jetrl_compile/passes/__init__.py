"""FX passes over captured graphs (graph in, graph out), the precision report and the dump."""

from .rewrite_linears import Fp8LinearPass, LinearSite, ParamInfo, RewriteResult, rewrite_linears

__all__ = ["Fp8LinearPass", "LinearSite", "ParamInfo", "RewriteResult", "rewrite_linears"]
