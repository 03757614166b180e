"""DFLASH on a pipeline-parallel PD prefill: which stage captures which draft feature,
and the per-stage partial projections summing to the single fc a PP1 server applies."""

import os
import socket
import unittest
from unittest import mock

import torch
from transformers import PretrainedConfig

from sglang.srt.speculative.dflash_pp import (
    CAPTURED_FEATURES_KEY,
    CONTEXT_PARTIAL_KEY,
    DFlashPPStage,
    fc_projection,
    feature_stages,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

KIMI_K3_IDS = [19, 37, 54, 66, 78, 90]


class TestFeatureStages(unittest.TestCase):
    def test_kimi_k3_pp8(self):
        # 93 layers over 8 stages: 11 or 12 each; feature L is read at layer L + 1.
        self.assertEqual(feature_stages(KIMI_K3_IDS, 93, 8), [1, 3, 4, 5, 6, 7])

    def test_a_feature_read_at_a_stage_boundary_goes_to_the_next_stage(self):
        # PP2 of 8 layers: [0, 4) and [4, 8); layer 3's output is layer 4's input.
        self.assertEqual(feature_stages([2, 3, 6], 8, 2), [0, 1, 1])

    def test_the_last_layer_is_read_at_the_final_norm(self):
        self.assertEqual(feature_stages([7], 8, 2), [1])

    def test_partition_from_the_environment(self):
        with mock.patch.dict(os.environ, {"SGLANG_PP_LAYER_PARTITION": "6,2"}):
            self.assertEqual(feature_stages([2, 3, 6], 8, 2), [0, 0, 1])

    def test_stage_roles(self):
        stages = [DFlashPPStage.build(KIMI_K3_IDS, 93, r, 8) for r in range(8)]
        self.assertEqual([list(s.features) for s in stages][:3], [[], [0], []])
        self.assertEqual(list(stages[7].features), [5])
        self.assertEqual(
            [s.receives_partial for s in stages], [False, False] + [True] * 6
        )

    def test_refusals(self):
        with self.assertRaisesRegex(ValueError, "SGLANG_PP_LAYER_PARTITION"):
            DFlashPPStage.build([1, 2], 8, 0, 2)
        with self.assertRaisesRegex(ValueError, "ascending"):
            DFlashPPStage.build([5, 1], 8, 0, 2)
        with self.assertRaisesRegex(ValueError, "ascending"):
            DFlashPPStage.build([1, 8], 8, 0, 2)


class TestPartialProjection(unittest.TestCase):
    def test_stages_hand_on_the_sum_of_their_projections(self):
        torch.manual_seed(0)
        hidden, tokens = 16, 5
        ids = [0, 2, 4]  # PP3 of 6 layers: one feature per stage
        fc = torch.randn(hidden, len(ids) * hidden)
        feats = [torch.randn(tokens, hidden) for _ in ids]
        inbound = None
        for rank in range(2):
            stage = DFlashPPStage.build(ids, 6, rank, 3)
            stage.fc_columns = fc[
                :, stage.features.start * hidden : stage.features.stop * hidden
            ]
            outbound = {CAPTURED_FEATURES_KEY: feats[rank], "hidden_states": None}
            stage.hand_on(outbound, inbound)
            self.assertNotIn(CAPTURED_FEATURES_KEY, outbound)
            self.assertEqual(outbound[CONTEXT_PARTIAL_KEY].dtype, torch.float32)
            inbound = outbound
        last = DFlashPPStage.build(ids, 6, 2, 3)
        total = fc_projection(
            feats[2], fc[:, 2 * hidden :], last.inbound_partial(inbound)
        )
        torch.testing.assert_close(total, torch.cat(feats, -1) @ fc.t())

    def test_a_stage_without_features_passes_the_partial_on(self):
        stage = DFlashPPStage.build([0, 6], 8, 1, 3)  # layers [2, 5): captures nothing
        partial = torch.randn(3, 4)
        outbound = {}
        stage.hand_on(outbound, {CONTEXT_PARTIAL_KEY: partial})
        self.assertEqual(outbound[CONTEXT_PARTIAL_KEY].data_ptr(), partial.data_ptr())


class TestLastStageProjection(unittest.TestCase):
    """The real DFlashDraftModel finishes the context from the partial."""

    @classmethod
    def setUpClass(cls):
        from sglang.test.layer_ut_utils import init_single_process_dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_single_process_dist(master_port=port)
        # RoPE's native path, as on a CPU build (SGLANG_USE_CPU_ENGINE).
        import sglang.srt.layers.rotary_embedding.base as rotary_base

        rotary_base._is_cpu = True

    def test_partial_plus_last_features_equals_the_full_projection(self):
        from sglang.srt.models.dflash import DFlashDraftModel

        hidden = 64
        config = PretrainedConfig(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            vocab_size=512,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            torch_dtype="float32",
            block_size=4,
            num_target_layers=8,
            dflash_config=dict(
                block_size=4, mask_token_id=260, target_layer_ids=[1, 3, 5]
            ),
        )
        model = DFlashDraftModel(config).eval()
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
            feats = torch.randn(6, 3 * hidden)
            expected = model.project_target_hidden(feats)
            partial = feats[:, : 2 * hidden] @ model.fc.weight[:, : 2 * hidden].t()
            padded = torch.cat(
                [partial, torch.randn(2, hidden)]
            )  # trailing padding rows
            got = model.project_target_hidden(
                feats[:, 2 * hidden :], context_partial=padded
            )
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    unittest.main()
