"""The test doubles behave like the hardware they stand in for, so adapter tests can lean on them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fakes.fake_process import FakeDeviceProcessError, run_in_fake_device_process
from tests.fakes.recording_backend import register_recording_backend

pytestmark = pytest.mark.heavy  # outside the quick tier (scripts/test.sh --fast); run in CI

TENSOR_BASICS = """
import torch
import torch.nn.functional as F
from tests.fakes.fake_device import install_fake_device

install_fake_device("neuron")  # a second install of the same name is a no-op
torch.manual_seed(0)
x, w = torch.randn(4, 8), torch.randn(8, 8)
q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))


def ops(x, w, q, k, v):
    return {
        "matmul": x @ w,
        "softmax": (x * 3).softmax(-1),
        "layer_norm": F.layer_norm(x, (8,)),
        "view_then_in_place": x.clone().view(32).mul_(2).view(4, 8),
        "sdpa": F.scaled_dot_product_attention(q, k, v),
        "half": (x.half() @ w.half()).float(),
    }


on_cpu = ops(x, w, q, k, v)
on_device = ops(*(t.to("neuron") for t in (x, w, q, k, v)))


def error_of(call):
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


try:
    install_fake_device("tpu")
except RuntimeError:
    second_name_refused = True
else:
    second_name_refused = False

result = {
    "device_of_moved": str(x.to("neuron").device),
    "devices_of_results": sorted({t.device.type for t in on_device.values()}),
    "max_difference": {n: (on_device[n].cpu() - on_cpu[n]).abs().max().item() for n in on_cpu},
    "back_on_cpu": type(on_device["matmul"].cpu()) is torch.Tensor,
    "factories": [str(torch.zeros(2, device="neuron").device), str(torch.arange(3, device="neuron").device)],
    "module_weight_device": str(torch.nn.Linear(2, 2).to("neuron").weight.device),
    "current_accelerator": str(torch.accelerator.current_accelerator()),
    "device_count": torch.accelerator.device_count(),
    "device_module_available": torch.neuron.is_available(),
    "mixed_devices_error": error_of(lambda: x.to("neuron") + x),
    "zero_dim_cpu_operand_error": error_of(lambda: x.to("neuron") * torch.tensor(2.0)),
    "cpu_generator_error": error_of(
        lambda: torch.randn(2, device="neuron", generator=torch.Generator().manual_seed(0))
    ),
    "second_name_refused": second_name_refused,
}
"""

COMPILE_ON_DEVICE = """
import torch
from tests.fakes.recording_backend import register_recording_backend

records = register_recording_backend("tpu")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))) + x.mean()


block = Block().eval()
block.requires_grad_(False)
x = torch.randn(3, 8)
expected = block(x)
block.to("tpu").compile(backend="tpu", fullgraph=True, dynamic=False)
graphs_after = []
for rows in (3, 3, 5):
    out = block(torch.randn(rows, 8).to("tpu") if rows != 3 else x.to("tpu"))
    graphs_after.append(len(records))
result = {
    "graphs_after_each_call": graphs_after,
    "output_device": str(out.device),
    "input_device_types": sorted(set(records[0].input_device_types)),
    "max_difference": (block(x.to("tpu")).cpu() - expected).abs().max().item(),
    "same_list_again": register_recording_backend("tpu") is records,
}
"""

TINY_PIPELINE_ON_DEVICE = """
import torch
from acceldemo.models.tiny import build_tiny_pipeline
from tests.fakes.recording_backend import register_recording_backend

records = register_recording_backend("neuron")


def generate(pipe, size=64):
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt="a red fox", height=size, width=size, num_inference_steps=2, guidance_scale=0.0,
        output_type="pt", generator=torch.Generator("cpu").manual_seed(0),
    ).images


pipe = build_tiny_pipeline("flux1")
expected = generate(pipe)
pipe.to("neuron")
eager = generate(pipe)

pipe.transformer.compile(backend="neuron", fullgraph=True, dynamic=False)
graphs_after = []
for _ in range(2):
    compiled = generate(pipe)
    graphs_after.append(len(records))

offloaded = build_tiny_pipeline("flux1")
offloaded.enable_model_cpu_offload()
offload_image = generate(offloaded)

result = {
    "pipeline_device": str(pipe.device),
    "image_device": str(eager.device),
    "eager_difference": (eager.cpu() - expected).abs().max().item(),
    "graphs_after_each_call": graphs_after,
    "graph_input_devices": sorted(set(records[0].input_device_types)),
    "compiled_difference": (compiled.cpu() - expected).abs().max().item(),
    "offload_device": str(offloaded._offload_device),
    "offload_difference": (offload_image.cpu() - expected).abs().max().item(),
}
"""


@pytest.fixture(scope="module")
def tensor_basics() -> dict[str, Any]:
    return run_in_fake_device_process("neuron", TENSOR_BASICS)


@pytest.fixture(scope="module")
def compile_on_device() -> dict[str, Any]:
    return run_in_fake_device_process("tpu", COMPILE_ON_DEVICE)


@pytest.fixture(scope="module")
def tiny_pipeline_on_device() -> dict[str, Any]:
    return run_in_fake_device_process("neuron", TINY_PIPELINE_ON_DEVICE, timeout_s=180)


def test_moved_tensors_report_the_fake_device(tensor_basics: dict[str, Any]) -> None:
    assert tensor_basics["device_of_moved"] == "neuron:0"
    assert tensor_basics["devices_of_results"] == ["neuron"]
    assert tensor_basics["factories"] == ["neuron:0", "neuron:0"]
    assert tensor_basics["module_weight_device"] == "neuron:0"
    assert tensor_basics["back_on_cpu"]


def test_ops_on_the_fake_device_compute_what_cpu_computes(tensor_basics: dict[str, Any]) -> None:
    for op, difference in tensor_basics["max_difference"].items():
        assert difference < 1e-5, op


def test_fake_device_is_the_current_accelerator(tensor_basics: dict[str, Any]) -> None:
    assert tensor_basics["current_accelerator"] == "neuron"
    assert tensor_basics["device_count"] == 1
    assert tensor_basics["device_module_available"]


def test_mixing_cpu_and_device_tensors_fails_as_on_hardware(tensor_basics: dict[str, Any]) -> None:
    assert "same device" in tensor_basics["mixed_devices_error"]
    assert tensor_basics["zero_dim_cpu_operand_error"] is None
    assert "generator" in tensor_basics["cpu_generator_error"]


def test_a_process_holds_one_fake_device(tensor_basics: dict[str, Any]) -> None:
    assert tensor_basics["second_name_refused"]


def test_failing_code_reports_the_child_error() -> None:
    with pytest.raises(FakeDeviceProcessError, match="ZeroDivisionError"):
        run_in_fake_device_process("tpu", "result = 1 / 0")


def test_recording_backend_records_each_graph_once_per_shape_on_cpu() -> None:
    records = register_recording_backend("recording-backend-under-test")
    assert register_recording_backend("recording-backend-under-test") is records
    double = torch.compile(lambda x: x * 2, backend="recording-backend-under-test", fullgraph=True, dynamic=False)
    for rows in (2, 2, 3):
        double(torch.ones(rows))
    assert len(records) == 2
    assert records[0].input_count == 1
    assert records[0].input_device_types == ("cpu",)


def test_recording_backend_refuses_a_name_someone_else_registered() -> None:
    with pytest.raises(ValueError, match="inductor"):
        register_recording_backend("inductor")


def test_second_call_at_a_shape_compiles_nothing_on_the_fake_device(
    compile_on_device: dict[str, Any],
) -> None:
    first, same_shape, new_shape = compile_on_device["graphs_after_each_call"]
    assert first >= 1
    assert same_shape == first
    assert new_shape == first + 1
    assert compile_on_device["same_list_again"]


def test_compiled_graphs_take_inputs_on_the_fake_device(compile_on_device: dict[str, Any]) -> None:
    assert compile_on_device["input_device_types"] == ["tpu"]
    assert compile_on_device["output_device"] == "tpu:0"
    assert compile_on_device["max_difference"] < 1e-5


def test_tiny_pipeline_on_the_fake_device_paints_the_cpu_image(
    tiny_pipeline_on_device: dict[str, Any],
) -> None:
    assert tiny_pipeline_on_device["pipeline_device"] == "neuron:0"
    assert tiny_pipeline_on_device["image_device"] == "neuron:0"
    assert tiny_pipeline_on_device["eager_difference"] < 1e-4


def test_tiny_transformer_compiles_once_on_the_fake_device(
    tiny_pipeline_on_device: dict[str, Any],
) -> None:
    assert tiny_pipeline_on_device["graphs_after_each_call"] == [1, 1]
    assert tiny_pipeline_on_device["graph_input_devices"] == ["neuron"]
    assert tiny_pipeline_on_device["compiled_difference"] < 1e-4


def test_model_cpu_offload_finds_the_fake_device(tiny_pipeline_on_device: dict[str, Any]) -> None:
    assert tiny_pipeline_on_device["offload_device"] == "neuron:0"
    assert tiny_pipeline_on_device["offload_difference"] < 1e-4
