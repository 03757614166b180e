"""A prompt that tokenizes to zero tokens is refused where prompts are checked."""

import unittest
from types import SimpleNamespace

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.runtime_context import get_context
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

CONTEXT = 64


def _validate(num_tokens: int, session_params=None) -> None:
    # The fields the check reads; a real TokenizerManager starts a scheduler.
    tm = object.__new__(TokenizerManager)
    tm.context_len, tm.num_reserved_tokens = CONTEXT, 0
    tm.allow_auto_truncate, tm.validate_total_tokens, tm.is_generation = (
        False,
        True,
        True,
    )
    tm.model_config = SimpleNamespace(joint_head_config=None, pointer_head=None)
    obj = GenerateReqInput(
        text="x", sampling_params={"max_new_tokens": 4}, session_params=session_params
    )
    obj.normalize_batch_and_arguments()
    tm._validate_one_request(obj, list(range(num_tokens)))


class TestEmptyPrompt(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        get_context().override_server_args(device="cpu").install()

    def test_zero_tokens_refused(self):
        with self.assertRaisesRegex(ValueError, "empty"):
            _validate(0)

    def test_an_empty_session_turn_admitted(self):
        _validate(0, session_params={"id": "s0"})

    def test_one_token_admitted(self):
        _validate(1)

    def test_over_long_prompt_still_refused(self):
        with self.assertRaisesRegex(ValueError, "longer than"):
            _validate(CONTEXT + 1)


if __name__ == "__main__":
    unittest.main()
