"""Test set-up: 8 host CPU devices, faithful rounding and strict dtype promotion.

XLA reads XLA_FLAGS once, when the first backend starts, so the flags are set here before
any backend starts.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "").split()
if "--xla_force_host_platform_device_count=8" not in _flags:
  _flags.append("--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import precision  # noqa: E402  (importing JAX starts no backend)

# The faithful-rounding flags (and on a CPU with native f16, the ISA ceiling that keeps
# f16 multiply-adds rounded per op), before any backend starts.
precision.enable_faithful_rounding()

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

# Strict promotion: a silent upcast (bf16 + f32 -> f32) inside the library raises a
# TypePromotionError instead of quietly changing the precision a test checks. Where a
# dependency cannot run under it, the library scopes "standard" promotion around that one
# call and says why in a comment.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def devices():
  return jax.devices()


# Tests that each took 5 to 67 s on this 2-core machine (pytest --durations, 2026-12-01
# and, from test_autocast_cache's retrace test on, 2026-12-02)
# run with the slow set (`python -m pytest -m slow`, which CI runs after the fast set),
# so that the README's fast command stays under 10 minutes. Most keep a faster sibling in
# the fast set (another recipe, stage, model, or the same property on a smaller case);
# some do not (DataParallel.telemetry's, whose stage 3 case was already slow), and run in
# the slow set only.
# A listed id that no longer exists fails the collection, so a rename cannot silently
# move a test back or drop it.
MOVED_TO_SLOW = frozenset("""
test_autocast_cache.py::test_apply_recipe_retrace_misses_as_few_as_handwritten
test_zoo.py::test_fp32_recipe_bit_identical_to_plain_model[resnet_batchnorm_linen]
test_zoo.py::test_fp32_recipe_bit_identical_to_plain_model[decoder_linen]
test_zoo.py::test_fp32_recipe_bit_identical_to_plain_model[gemma_style_nnx]
test_zoo.py::test_bf16_f32_ops_check_and_loss[bf16_configured_nnx]
test_numerics_telemetry.py::test_device_statistics_of_captured_tensors_equal_numpy[nnx]
test_numerics_telemetry.py::test_monitors_are_the_max_logit_and_log_partition
test_numerics_telemetry.py::test_train_step_with_telemetry_takes_the_same_step
test_numerics_telemetry.py::test_swamped_updates_are_named_in_the_16_bit_params_not_in_the_master
test_numerics_telemetry.py::test_data_parallel_telemetry_is_one_shards_inspect[0]
test_numerics_telemetry.py::test_value_and_grad_telemetry_on_a_params_pytree
test_train_fast.py::test_telemetry_record_matches_the_nnx_jit_probe
test_parallel.py::test_gpt_layer_by_layer_matches_stage_0
test_parallel.py::test_readme_block_with_dropout_trains_and_round_trips_a_checkpoint
test_parallel.py::test_checkpoint_resume_on_the_same_device_count_is_bit_exact[1]
test_train.py::test_bit_exact_resume[bf16_sr]
test_train.py::test_cross_recipe_restore_continues
test_train.py::test_cli_stops_a_run_that_only_produces_nonfinite_steps
test_fp8.py::test_trainlib_step_rolls_back_fp8_state_of_a_skipped_step
test_fp8.py::test_linen_collections_and_grad_state_merge
test_parallel_rounding.py::test_slice_with_offset_matches_whole[bf16-xla]
test_parallel_rounding.py::test_data_parallel_fused_recipe_same_bits_as_bf16_sr_in_every_stage
test_parallel_rounding.py::test_row_slice_of_2d_and_uint32_wrap
test_parallel_rounding.py::test_data_parallel_sr_same_bits_in_every_stage
test_parallel_rounding.py::test_sharded_fused_adamw_rounds_with_global_index[xla]
test_parallel_rounding.py::test_sharded_fused_recipe_rounds_like_the_unfused_recipe[pallas]
test_flax_nnx.py::test_fp32_policy_bit_identical[lm]
test_flax_nnx.py::test_bf16_layers_and_dtypes
test_flax_nnx.py::test_conv_einsum_embed_attend_gradients
test_flax_nnx.py::test_compiled_hlo_vs_handwritten
test_flax_linen.py::test_init_creates_params_in_param_dtype
test_autocast_parallel.py::test_sharded_model_trains_under_every_recipe[fp32]
test_activation_memory.py::test_gpt_recomputed_glue_bit_identical_to_kept[bf16_mixed]
test_activation_memory.py::test_gpt_recomputed_glue_bit_identical_to_kept[bf16_master]
test_activation_memory.py::test_gpt_bf16_activation_bytes_vs_fp32[small]
test_activation_memory.py::test_island_values_and_grads_bit_identical_to_plain_formula[rotary_embedding-bfloat16]
test_fused_adamw.py::test_checkpoint_of_another_recipe_restores_into_the_fused_recipe
test_fused_adamw.py::test_fused_matches_unfused_over_20_steps[master]
test_fused_adamw.py::test_fused_recipe_train_step_bit_identical_to_bf16_sr[xla]
test_fp8_autocast.py::test_linen_model_inside_a_function
test_fp8_autocast.py::test_delayed_state_per_scan_iteration_and_through_remat
test_fp8_autocast.py::test_fp8_state_under_plain_jax_value_and_grad
test_fp8_conformance.py::test_trains_with_finite_dropping_loss[plain_jax_scan_remat-fp8_hybrid]
test_fp8_conformance.py::test_trains_with_finite_dropping_loss[equinox_mlp-fp8_hybrid]
test_autocast.py::test_subclassed_layer_keeps_its_class_code_and_attributes
test_train_resume.py::test_a_torn_last_log_line_is_dropped_once
test_study_api.py::test_two_shards_and_report_only_equal_the_whole_run
test_study_api.py::test_aa_arm_and_time_to_target
test_autocast_cache.py::test_autocast_retrace_misses_as_few_as_handwritten
test_numerics_telemetry.py::test_traced_rows_are_inspects_rows_forward_and_backward[nnx]
test_numerics_telemetry.py::test_scale_plot_png
test_parallel_rounding.py::test_slice_with_offset_matches_whole[e4m3-xla]
test_flax_nnx.py::test_bf16_logits_close_to_f32
test_numerics_bisect.py::test_checkpoint_of_another_run_is_refused
test_zoo.py::test_bf16_f32_ops_check_and_loss[decoder_linen]
test_zoo.py::test_bf16_f32_ops_check_and_loss[resnet_batchnorm_linen]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[resnet_batchnorm_linen-bf16_mixed]
test_zoo.py::test_fp32_recipe_bit_identical_to_plain_model[multihead_attention_nnx]
test_numerics_telemetry_fp8.py::test_study_telemetry_has_fp8_rows[params]
test_numerics_inspect.py::test_mxfp8_whatif_against_reference_on_partial_and_transposed_blocks
test_numerics_device_stats.py::test_device_mxfp8_is_the_recipes_quantiser_bit_for_bit[2]
test_train_fast.py::test_bit_identical_to_the_nnx_jit_step[fp8_hybrid-skip]
test_parallel.py::test_checkpoint_of_8_devices_resumes_on_4[3]
test_checkpoint.py::test_cross_recipe_restore_converts_from_the_master[bf16_master-bf16_sr]
test_gpt.py::test_without_qk_norm
test_fused_adamw.py::test_fused_matches_unfused_over_20_steps[master_schedule]
test_optim_inplace.py::test_non_elementwise_optimizers_bit_identical[bf16_kahan-clip_adam]
test_optim_inplace.py::test_non_elementwise_optimizers_bit_identical[bf16_kahan-adafactor]
test_optim_inplace.py::test_non_elementwise_optimizers_bit_identical[pure_bf16-clip_adam]
test_optim_inplace.py::test_non_elementwise_optimizers_bit_identical[pure_bf16-lamb]
test_autocast_parallel.py::test_sharded_model_trains_under_every_recipe[bf16_mixed]
test_autocast_parallel.py::test_sharded_model_trains_under_every_recipe[bf16_kahan]
test_autocast_parallel.py::test_sharded_model_trains_under_every_recipe[bf16_sr]
test_autocast_parallel.py::test_sharded_model_trains_under_every_recipe[mxfp8]
test_autocast_parallel.py::test_sharded_model_trains_under_every_recipe[nvfp4]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[decoder_linen-bf16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[resnet_batchnorm_linen-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[bias_batchnorm_mlp_nnx-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[multihead_attention_nnx-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[plain_jax_scan_remat-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[explicit_sharding_nnx-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[dropout_split_merge_grad_nnx-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[train_keywords_linen-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[transform_with_state_haiku-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[stateful_equinox-f16_mixed]
test_zoo.py::test_every_gemm_forward_and_backward_is_compute_f32_on_cuda[scan_over_layers_nnx-f16_mixed]
test_activation_memory.py::test_island_values_and_grads_bit_identical_to_plain_formula[rotary_embedding-float32]
test_activation_memory.py::test_island_values_and_grads_bit_identical_to_plain_formula[attention_probs-float16]
test_activation_memory.py::test_island_values_and_grads_bit_identical_to_plain_formula[layer_norm-float32]
test_activation_memory.py::test_island_values_and_grads_bit_identical_to_plain_formula[rms_norm-float16]
test_gpu_lowering.py::test_training_step_gemm_dtypes[bf16_kahan-cuda]
test_gpu_lowering.py::test_training_step_gemm_dtypes[pure_bf16-cuda]
test_optim_inplace.py::test_every_recipe_bit_identical_to_the_previous_guard[fp8_hybrid]
test_optim_inplace.py::test_every_recipe_bit_identical_to_the_previous_guard[nvfp4]
test_optim_inplace.py::test_every_recipe_bit_identical_to_the_previous_guard[mxfp8]
test_optim_inplace.py::test_every_recipe_bit_identical_to_the_previous_guard[bf16_mixed]
test_optim_inplace.py::test_fused_adamw_skips_inside_its_pass[False-pallas]
test_optim_inplace.py::test_fused_adamw_skips_inside_its_pass[True-xla]
test_fp8.py::test_error_within_fp8_bound[per_channel-heavy]
test_fp8.py::test_error_within_fp8_bound[block-heavy]
test_fp8.py::test_error_within_fp8_bound[delayed-heavy]
test_fp8.py::test_error_within_fp8_bound[current-heavy]
test_train.py::test_import_plain_orbax_checkpoints_into_bf16_master
test_autocast_cache.py::test_retraces_leave_no_function_behind
test_study_api.py::test_more_seeds_grow_a_study_and_keep_its_cells
test_checkpoint_integrity.py::test_every_damaged_file_falls_back
""".split())


# The files with the most test time in the fast set (pytest --durations=0 on this machine,
# 2026-12-02), longest first. pytest-xdist's --dist loadfile hands files to the two
# workers in collection order, so these go first and the short files fill in at the end:
# both workers then finish at about the same time (the order only affects scheduling).
LONGEST_FIRST = """
test_zoo.py test_fp8.py test_parallel.py test_optim_inplace.py test_numerics_inspect.py
test_numerics_telemetry.py test_gpu_lowering.py test_autocast_parallel.py test_train_fast.py
test_fp8_autocast.py test_parallel_rounding.py test_autocast_cache.py test_fused_adamw.py
test_flax_linen.py test_flax_nnx.py test_activation_memory.py test_microscale.py
test_spike_guard.py test_train_step.py test_autocast_conformance.py test_gpt.py
test_train.py test_autocast.py test_numerics_telemetry_fp8.py
""".split()


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  position = {id(item): i for i, item in enumerate(items)}
  items.sort(key=lambda item: (rank.get(item.fspath.basename, len(rank)),
                               position[id(item)]))
  found = set()
  for item in items:
    key = item.nodeid.split("tests/", 1)[-1]
    if key in MOVED_TO_SLOW:
      item.add_marker(pytest.mark.slow)
      found.add(key)
  missing = MOVED_TO_SLOW - found
  # Only a whole-suite collection can see every listed test (a run of one file cannot).
  if missing and len({item.fspath for item in items}) > 30:
    raise pytest.UsageError(f"conftest.MOVED_TO_SLOW names tests that do not exist: "
                            f"{sorted(missing)}")
