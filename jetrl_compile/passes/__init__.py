"""FX passes over captured graphs (graph in, graph out), the precision report and the dump."""

from .rewrite_linears import LinearSite, ParamInfo, RewriteResult, rewrite_linears

__all__ = ["LinearSite", "ParamInfo", "RewriteResult", "rewrite_linears"]
