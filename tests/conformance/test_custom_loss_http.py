"""create_custom_loss at the HTTP level: hand-crafted malicious graphs get a 400 naming the node and target and
nothing is stored; a loss belongs to its session (another session or tenant gets 404); creates are idempotent
on (session, custom_loss_seq_id); chunked requests; a stored loss survives a gateway restart."""

from __future__ import annotations

import copy
import itertools
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from tests.conformance.test_sft import make_datum
from tests.support.server import ServerProcess

_seq = itertools.count(1000)


def scaled_nll(logprobs, weights):  # type: ignore[no-untyped-def]
    loss = -(torch.exp(logprobs) * weights).sum()
    return loss, {"custom/nll:sum": loss}


def _graph() -> dict[str, Any]:
    handle = trace_loss(scaled_nll, {"logprobs": 1, "weights": 1}, "s")
    return encode_graph(handle).model_dump(mode="json")


def _body(session_id: str, graph: dict[str, Any], seq: int | None = None) -> dict[str, Any]:
    return {"session_id": session_id, "custom_loss_seq_id": next(_seq) if seq is None else seq, "name": "scaled_nll",
            "inputs": [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}], "graph": graph}


def _post(server: ServerProcess, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/v1/{path}", json=body, headers={"X-API-Key": key}, timeout=30)


def _session(server: ServerProcess, key: str) -> str:
    r = _post(server, key, "create_session", {})
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def _stored(server: ServerProcess) -> int:
    with sqlite3.connect(server.data_dir / "twinkle.db") as db:
        return int(db.execute("select count(*) from custom_losses").fetchone()[0])


def _replace_call(graph: dict[str, Any], target: str, args: list[Any], kwargs: dict[str, Any] | None = None,
                  op: str = "call_function") -> dict[str, Any]:
    """The graph with its first call node (`exp`) turned into `op target(*args, **kwargs)`, keeping its name."""
    g = copy.deepcopy(graph)
    node = next(n for n in g["nodes"] if n["op"] in ("call_function", "call_method"))
    node.update(op=op, target=target, args=args, kwargs=kwargs or {})
    return g


LP = {"ref": "logprobs"}
MALICIOUS = {
    "torch.load": lambda g: _replace_call(g, "torch.load", ["/etc/passwd"]),
    "torch.save": lambda g: _replace_call(g, "torch.save", [LP, "/tmp/x.pt"]),
    "torch.from_file": lambda g: _replace_call(g, "torch.from_file", ["/etc/shadow"], {"size": 100}),
    "builtins.eval": lambda g: _replace_call(g, "builtins.eval", ["__import__('os').system('touch /tmp/pwned')"]),
    "builtins.exec": lambda g: _replace_call(g, "builtins.exec", ["import os"]),
    "builtins.open": lambda g: _replace_call(g, "builtins.open", ["/etc/passwd"]),
    "builtins.__import__": lambda g: _replace_call(g, "builtins.__import__", ["os"]),
    "builtins.getattr": lambda g: _replace_call(g, "builtins.getattr", [LP, "__class__"]),
    "getattr-dunder": lambda g: _replace_call(g, "getattr", [LP, "__class__"]),
    "getattr-data-ptr": lambda g: _replace_call(g, "getattr", [LP, "data_ptr"]),
    "os.system": lambda g: _replace_call(g, "os.system", ["id"]),
    "subprocess.run": lambda g: _replace_call(g, "subprocess.run", [["id"]]),
    "pickle.loads": lambda g: _replace_call(g, "pickle.loads", ["gASVAAAA"]),
    "torch.ones-huge": lambda g: _replace_call(g, "torch.ones", [[100000, 100000]]),
    "torch.zeros-huge": lambda g: _replace_call(g, "torch.zeros", [1000000000]),
    "torch.full-huge": lambda g: _replace_call(g, "torch.full", [{"tuple": [65536, 65536]}, 1.0]),
    "torch.arange-huge": lambda g: _replace_call(g, "torch.arange", [10**12]),
    "torch.empty": lambda g: _replace_call(g, "torch.empty", [10]),
    "method-backward": lambda g: _replace_call(g, "backward", [LP], op="call_method"),
    "method-reduce": lambda g: _replace_call(g, "__reduce_ex__", [LP, 2], op="call_method"),
    "method-numpy": lambda g: _replace_call(g, "numpy", [LP], op="call_method"),
    "method-inplace": lambda g: _replace_call(g, "mul_", [LP, 0], op="call_method"),
    "operator.setitem": lambda g: _replace_call(g, "operator.setitem", [LP, 0, 1.0]),
    "operator.lshift": lambda g: _replace_call(g, "operator.lshift", [1, 10**9]),
    "out-kwarg": lambda g: _replace_call(g, "torch.exp", [LP], {"out": LP}),
    "get_attr-node": lambda g: _replace_call(g, "_tensor_constant0", [], op="get_attr"),
    "call_module-node": lambda g: _replace_call(g, "linear", [LP], op="call_module"),
    "unknown-constant": lambda g: _replace_call(g, "torch.exp", [{"pickle": "gASV"}]),
    "forward-ref": lambda g: _replace_call(g, "torch.exp", [{"ref": "output"}]),
    "unhashable-ref": lambda g: _replace_call(g, "torch.exp", [{"ref": []}]),
    "unhashable-attr": lambda g: _replace_call(g, "getattr", [LP, ["shape"]]),
    "out-zero": lambda g: _replace_call(g, "torch.exp", [LP], {"out": 0}),
    # writes into an existing tensor passed positionally or as inplace=; sizes a CUDA kernel trusts; sparse grads
    "relu-inplace-positional": lambda g: _replace_call(g, "torch.nn.functional.relu", [LP, True]),
    "silu-inplace-kwarg": lambda g: _replace_call(g, "torch.nn.functional.silu", [LP], {"inplace": True}),
    "normalize-out-positional": lambda g: _replace_call(g, "torch.nn.functional.normalize", [LP, 2.0, 0, 1e-12, LP]),
    "repeat_interleave-output_size": lambda g: _replace_call(g, "repeat_interleave", [LP, 2], {"output_size": 3},
                                                             op="call_method"),
    "gather-sparse_grad": lambda g: _replace_call(g, "torch.gather", [LP, 0, LP], {"sparse_grad": True}),
    "diff-order": lambda g: _replace_call(g, "torch.diff", [LP], {"n": 5000}),
}


@pytest.fixture(scope="module")
def session_a(server: ServerProcess) -> str:
    return _session(server, server.api_key_a)  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_malicious_graph_is_refused_and_not_stored(server: ServerProcess, session_a: str, case: str) -> None:
    key = server.api_key_a  # type: ignore[attr-defined]
    graph = MALICIOUS[case](_graph())
    target = next(n for n in graph["nodes"] if n["name"] == "exp")["target"]
    before = _stored(server)
    r = _post(server, key, "create_custom_loss", _body(session_a, graph))
    assert r.status_code == 400, (case, r.text)
    body = r.json()
    assert body["category"] == "user" and body["detail"].startswith("custom loss rejected"), body
    assert "'exp'" in body["detail"] and target in body["detail"], body  # names the node and its target
    assert _stored(server) == before


def test_size_limits(server: ServerProcess, session_a: str) -> None:
    key = server.api_key_a  # type: ignore[attr-defined]
    before = _stored(server)
    g = _graph()
    out = g["nodes"].pop()
    last = g["nodes"][-1]["name"]
    for i in range(600):  # too many nodes
        g["nodes"].append({"op": "call_function", "name": f"pad_{i}", "target": "operator.add",
                           "args": [{"ref": last}, 0.0], "kwargs": {}})
    g["nodes"].append(out)
    r = _post(server, key, "create_custom_loss", _body(session_a, g))
    assert r.status_code == 400 and "at most 512" in r.json()["detail"], r.text
    long_name = _graph()
    long_name["nodes"][2]["name"] = "x" * 300
    r = _post(server, key, "create_custom_loss", _body(session_a, long_name))
    assert r.status_code == 400 and "identifiers" in r.json()["detail"], r.text
    many_inputs = _body(session_a, _graph())
    many_inputs["inputs"] += [{"name": f"x{i}", "rank": 1} for i in range(20)]
    r = _post(server, key, "create_custom_loss", many_inputs)
    assert r.status_code == 400 and "at most 16" in r.json()["detail"], r.text
    huge = _body(session_a, _graph())
    huge["name"] = "n" * 600_000  # over the request size limit
    r = _post(server, key, "create_custom_loss", huge)
    assert r.status_code == 413, r.text
    bad_json = httpx.post(f"{server.base_url}/api/v1/create_custom_loss", content=b"{not json",
                          headers={"X-API-Key": key, "content-type": "application/json"})
    assert bad_json.status_code == 400 and "invalid create_custom_loss body" in bad_json.json()["detail"]
    assert _stored(server) == before


def test_create_is_idempotent_per_seq_id(server: ServerProcess, session_a: str) -> None:
    key = server.api_key_a  # type: ignore[attr-defined]
    seq = next(_seq)
    before = _stored(server)
    first = _post(server, key, "create_custom_loss", _body(session_a, _graph(), seq))
    again = _post(server, key, "create_custom_loss", _body(session_a, _graph(), seq))
    assert first.status_code == again.status_code == 200
    loss_id = first.json()["request_id"]
    assert again.json()["request_id"] == loss_id and _stored(server) == before + 1
    other = _replace_call(_graph(), "torch.sigmoid", [LP])
    clash = _post(server, key, "create_custom_loss", _body(session_a, other, seq))
    assert clash.status_code == 400 and "already used for a different loss" in clash.json()["detail"]
    answer = _post(server, key, "retrieve_future", {"request_id": loss_id})
    assert answer.json() == {"loss_id": loss_id, "type": "create_custom_loss"}
    assert _stored(server) == before + 1


@pytest.fixture(scope="module")
def own_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A server of this module's own (it is restarted), sending at most 2 datums per forward_backward chunk."""
    srv = ServerProcess(tmp_path_factory.mktemp("custom-loss"), str(tiny_model_dir),
                        env={"TWINKLE_CLIENT_FWDBWD_MAX_CHUNK_LEN": "2"})
    key = srv.create_key("custom")
    srv.start()
    yield srv, key
    srv.stop()


def test_chunked_requests_and_a_gateway_restart(own_server) -> None:  # type: ignore[no-untyped-def]
    """5 datums in 3 chunks: the server-side loss sums like the client-side one; after a gateway restart the
    stored loss still resolves (future, retry, and a new training run of the same session)."""
    srv, key = own_server
    rng = np.random.default_rng(9)
    data = []
    for _ in range(5):
        d = make_datum(rng.integers(5, 200, size=int(rng.integers(5, 11))).tolist())
        d.loss_fn_inputs["weights"] = types.TensorData.from_numpy(
            rng.uniform(-1, 1, d.model_input.length).astype(np.float32))
        data.append(d)

    def client_side(batch: list[types.Datum], logprobs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        total = sum(scaled_nll(lp, d.loss_fn_inputs["weights"].to_torch())[0] for d, lp in zip(batch, logprobs))
        return total, {}

    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=key)
    handle = sc.create_custom_loss(scaled_nll, {"logprobs": 1, "weights": 1}).result()
    a = sc.create_lora_training_client(base_model=srv.base_model, rank=4, seed=31).result()
    b = sc.create_lora_training_client(base_model=srv.base_model, rank=4, seed=31).result()
    out_a = a.forward_backward_custom(data, handle).result()
    out_b = b.forward_backward_custom(data, client_side).result()
    assert len(out_a.loss_fn_outputs) == 5
    assert out_a.metrics["loss:sum"] == pytest.approx(out_b.metrics["loss:sum"], rel=1e-6)

    srv.kill()  # the loss is in SQL: a restarted gateway still has it
    srv.start()
    session_id = sc.holder.get_session_id()
    assert _post(srv, key, "retrieve_future", {"request_id": handle.loss_id}).json()["loss_id"] == handle.loss_id
    retry = _body(session_id, encode_graph(handle).model_dump(mode="json"), seq=0)
    retry["name"] = handle.name
    assert _post(srv, key, "create_custom_loss", retry).json()["request_id"] == handle.loss_id
    c = sc.create_lora_training_client(base_model=srv.base_model, rank=4, seed=31).result()
    out_c = c.forward_backward_custom(data, handle).result()
    assert out_c.metrics["loss:sum"] == pytest.approx(out_a.metrics["loss:sum"], rel=1e-6)  # same seed, same start
    sc.close("success")


def test_loss_belongs_to_its_session_and_tenant(server: ServerProcess) -> None:
    key_a, key_b = server.api_key_a, server.api_key_b  # type: ignore[attr-defined]
    datum = make_datum(list(range(5, 15)))
    with tinker.ServiceClient(base_url=server.base_url, api_key=key_a) as sc:
        handle = sc.create_custom_loss(scaled_nll, {"logprobs": 1, "weights": 1}).result()
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
        assert np.isfinite(tc.forward_backward_custom([datum], handle).result().metrics["loss:sum"])
    loss_id = handle.loss_id
    with tinker.ServiceClient(base_url=server.base_url, api_key=key_a) as other_session:
        tc = other_session.create_lora_training_client(base_model=server.base_model, rank=2).result()
        with pytest.raises(tinker.NotFoundError, match="not found"):
            tc.forward_backward([datum], "custom", {"loss_id": loss_id}).result()
    with tinker.ServiceClient(base_url=server.base_url, api_key=key_b) as tenant_b:
        tc = tenant_b.create_lora_training_client(base_model=server.base_model, rank=2).result()
        with pytest.raises(tinker.NotFoundError, match="not found"):
            tc.forward_backward([datum], "custom", {"loss_id": loss_id}).result()
        # the model goes on after the refusals (they consumed their seq_ids)
        assert np.isfinite(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
    assert _post(server, key_b, "retrieve_future", {"request_id": loss_id}).status_code == 404
    before = _stored(server)
    r = _post(server, key_b, "create_custom_loss", _body(_session(server, key_a), _graph()))
    assert r.status_code == 404  # tenant B cannot create a loss in tenant A's session
    assert _stored(server) == before


def test_a_seq_id_beyond_sql_integer_is_a_400(server: ServerProcess, session_a: str) -> None:
    key = server.api_key_a  # type: ignore[attr-defined]
    r = _post(server, key, "create_custom_loss", _body(session_a, _graph(), 2**31))
    assert r.status_code == 400 and "custom_loss_seq_id" in r.json()["detail"], r.text
