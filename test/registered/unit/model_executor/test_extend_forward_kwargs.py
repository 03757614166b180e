"""`ModelRunner._extend_forward_kwargs` passes `input_embeds` in the model's dtype."""

import unittest
from types import SimpleNamespace

import torch

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


def _runner(dtype: torch.dtype) -> ModelRunner:
    # Only the attributes the method reads; a real runner needs a model and a device.
    runner = object.__new__(ModelRunner)
    runner.support_pp = False
    runner.is_generation = True
    runner.dtype = dtype
    return runner


def _batch(embeds: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(
        input_embeds=embeds, replace_embeds=None, replace_positions=None, input_ids=None
    )


class TestExtendForwardKwargs(unittest.TestCase):
    def test_fp32_model_gets_fp32_embeds_unrounded(self):
        embeds = torch.linspace(-1, 1, 24, dtype=torch.float32).reshape(3, 8) / 3
        kwargs = _runner(torch.float32)._extend_forward_kwargs(_batch(embeds), None)
        self.assertEqual(kwargs["input_embeds"].dtype, torch.float32)
        self.assertTrue(torch.equal(kwargs["input_embeds"], embeds))
        torch.nn.Linear(8, 8)(
            kwargs["input_embeds"]
        )  # an fp32 first layer accepts them

    def test_bf16_model_gets_bf16_embeds(self):
        embeds = torch.randn(3, 8)
        kwargs = _runner(torch.bfloat16)._extend_forward_kwargs(_batch(embeds), None)
        self.assertTrue(torch.equal(kwargs["input_embeds"], embeds.bfloat16()))


if __name__ == "__main__":
    unittest.main()
