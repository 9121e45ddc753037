"""A multi-layer perceptron in numpy: ReLU hidden layers, softmax
cross-entropy, SGD with momentum. Pure functions of arrays, so the same code
runs in one process (the reference) and as Dask tasks (one rank each).

Parameters are a list with one ``{"W": (fan_in, fan_out), "b": (fan_out,)}``
per layer, in model order; gradients have the same structure. Back-propagation
is split per layer so that a data-parallel step can compute (and all-reduce)
the last layer's gradient while earlier layers are still running:

* :func:`forward` keeps each layer's input ``a[l]`` and the gradient of the
  loss with respect to the logits (``delta``);
* :func:`layer_grad` is layer ``l``'s gradient from ``a[l]`` and the delta
  at its output;
* :func:`backprop` carries the delta one layer down.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def layer_sizes(inputs: int, hidden: tuple[int, ...], classes: int) -> list[int]:
    return [inputs, *hidden, classes]


def init_params(sizes: list[int], seed: int, dtype: str = "float32") -> list[dict[str, np.ndarray]]:
    """He-initialised weights, zero biases; the same for a given seed."""
    rng = np.random.default_rng(seed)
    return [{"W": (rng.standard_normal((m, n)) * np.sqrt(2.0 / m)).astype(dtype), "b": np.zeros(n, dtype=dtype)}
            for m, n in zip(sizes[:-1], sizes[1:])]


def init_state(sizes: list[int], seed: int, dtype: str = "float32") -> dict[str, Any]:
    """Parameters and zero momentum buffers."""
    params = init_params(sizes, seed, dtype)
    return {"params": params, "velocity": [{k: np.zeros_like(v) for k, v in p.items()} for p in params]}


def forward(params: list[dict], X: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Logits, mean cross-entropy and what back-propagation needs.

    Returns
    -------
    dict
        ``a``: each layer's input; ``delta``: d(mean loss)/d(logits);
        ``loss``; ``correct``: number of right predictions.
    """
    a = [X]
    h = X
    for i, p in enumerate(params):
        z = h @ p["W"] + p["b"]
        if i < len(params) - 1:
            h = np.maximum(z, 0)
            a.append(h)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    prob = e / e.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(prob[np.arange(n), y] + 1e-12).mean())
    delta = prob
    delta[np.arange(n), y] -= 1
    delta /= n
    return {"a": a, "delta": delta.astype(X.dtype, copy=False), "loss": loss,
            "correct": int((z.argmax(axis=1) == y).sum()), "n": n}


def layer_grad(cache: dict, delta: np.ndarray | None, layer: int) -> dict[str, np.ndarray]:
    """Gradient of layer ``layer`` (``delta`` at its output; None: the logits')."""
    d = cache["delta"] if delta is None else delta
    return {"W": cache["a"][layer].T @ d, "b": d.sum(axis=0)}


def backprop(cache: dict, params: list[dict], delta: np.ndarray | None, layer: int) -> np.ndarray:
    """The delta at the output of layer ``layer - 1`` (through ReLU)."""
    d = cache["delta"] if delta is None else delta
    return (d @ params[layer]["W"].T) * (cache["a"][layer] > 0)


def backward(cache: dict, params: list[dict]) -> list[dict[str, np.ndarray]]:
    """All layers' gradients (for the single-process reference)."""
    grads: list[dict] = [{} for _ in params]
    delta = None
    for layer in reversed(range(len(params))):
        grads[layer] = layer_grad(cache, delta, layer)
        if layer:
            delta = backprop(cache, params, delta, layer)
    return grads


def sgd_momentum(state: dict, grads: list[dict], lr: float, momentum: float) -> dict[str, Any]:
    """PyTorch's SGD with momentum: ``v = m v + g; w -= lr v`` (new arrays)."""
    params, velocity = [], []
    for p, v, g in zip(state["params"], state["velocity"], grads):
        nv = {k: momentum * v[k] + np.asarray(g[k], dtype=v[k].dtype) for k in p}
        velocity.append(nv)
        params.append({k: p[k] - lr * nv[k] for k in p})
    return {"params": params, "velocity": velocity}


def evaluate(params: list[dict], X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy and accuracy on ``(X, y)``."""
    out = forward(params, X, y)
    return out["loss"], out["correct"] / max(1, out["n"])
