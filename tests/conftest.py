"""Shared fixtures: tiny Hugging Face checkpoints made on the spot, a private offload dir,
tiny random-weight runtimes."""
from __future__ import annotations

import os

import pytest
import torch

# Start-up progress lines come only when a step is slow, which on a busy machine is any
# time: tests that count stderr lines would see them at random (tests/test_progress.py
# turns them back on). Set here so that subprocesses inherit it.
os.environ["IMPRESS_FLEXGEN_PROGRESS"] = "0"


# Real-model, subprocess, benchmark and crash-harness tests: `pytest -m "not slow"` leaves
# them out for a quick run (CI runs everything). Chosen by measured duration (1.5 s and more
# on the 2-core machine); whole modules where a module fixture carries the cost.
SLOW_MODULES = {"tests/test_accuracy.py", "tests/test_crash_test.py", "tests/test_verify.py"}
SLOW_TESTS = {
    "tests/test_experiments.py::test_compression_fidelity_compares_every_format_with_fp32",
    "tests/test_batching.py::test_batched_equals_alone_at_full_retention",
    "tests/test_bench_io.py::test_bench_io_quick",
    "tests/test_bench_remote.py::test_bench_remote_tiny",
    "tests/test_cli.py::test_help_lists_every_option",
    "tests/test_cli.py::test_main_job_refuses_a_foreign_store_dir",
    "tests/test_cli.py::test_main_job_serves_compares_and_reuses_its_store",
    "tests/test_cli.py::test_run_bad_input_is_one_line_exit_2",
    "tests/test_cli.py::test_run_unwritable_json_is_a_user_error",
    "tests/test_cli.py::test_verify_bad_input_is_one_line_exit_2",
    "tests/test_cli_refusals.py::test_sigterm_exits_through_the_cleanup",
    "tests/test_compat.py::test_disk_threads_never_hang_exit",
    "tests/test_compression.py::test_4bit_weights_in_flexgens_loop_at_every_placement",
    "tests/test_compression.py::test_4bit_kv_cache_in_flexgens_loop",
    "tests/test_compat.py::test_raw_flexgen_disk_threads_would_hang_exit",
    "tests/test_compat.py::test_unpatched_flexgen_fails_on_cpu_as_documented",
    "tests/test_concurrency.py::test_store_serves_exact_kv_under_concurrent_requests",
    "tests/test_device_selection.py::test_chunks_from_a_gpu_tier_and_from_the_host_meet_on_the_device",
    "tests/test_device_selection.py::test_decode_pages_are_handed_to_the_device_and_chosen_as_on_the_host",
    "tests/test_device_selection.py::test_exact_policies_give_full_attentions_tokens_on_every_device",
    "tests/test_device_selection.py::test_selection_runs_on_its_device_and_chooses_as_on_the_host",
    "tests/test_engine.py::test_reuse_after_reopen_in_a_new_process",
    "tests/test_engine.py::test_smollm2_retention_one_matches_generation",
    "tests/test_exact_store.py::test_smollm2_stored_and_recomputed_answers_have_identical_logprobs",
    "tests/test_exact_store.py::test_an_exact_answer_does_not_depend_on_how_its_prefix_was_stored",
    "tests/test_exact_store.py::test_the_stored_vs_computed_harness_passes_quick",
    "tests/test_exact_store.py::test_bench_exact_quick_times_both_ways_and_sizes_every_format",
    "tests/test_entrypoints.py::test_jobs_take_their_modules_flags_and_user_errors",
    "tests/test_gpu_repro.py::test_quick_cpu_run_writes_both_modes_and_all_policies",
    "tests/test_identity.py::test_a_given_store_dir_of_another_seed_is_refused_in_one_line",
    "tests/test_identity.py::test_another_seed_takes_nothing_from_the_store_of_the_first",
    "tests/test_identity.py::test_two_checkpoints_of_one_shape_never_share_kv",
    "tests/test_opt_fp32.py::test_an_fp16_checkpoint_on_disk_is_cast_to_the_compute_dtype",
    "tests/test_opt_fp32.py::test_verify_opt_tiny_matches_transformers_by_default",
    "tests/test_placement.py::test_activations_on_disk_are_refused_at_argument_checking",
    "tests/test_placement.py::test_output_is_identical_across_placements_and_loops",
    "tests/test_placement_auto.py::test_opt_30b_starts_and_answers_within_seconds",
    "tests/test_pool_cluster.py::test_a_master_killed_mid_run_costs_misses_never_wrong_kv",
    "tests/test_pool_cluster.py::test_chunk_keys_spread_over_the_masters_and_read_back_bit_exact",
    "tests/test_pool_cluster.py::test_two_processes_share_a_prefix_through_the_cluster",
    "tests/test_pool_metrics.py::test_pool_events_in_metrics_and_flags_reach_the_pool",
    "tests/test_reproduce.py::test_peers_quick",
    "tests/test_reproduce.py::test_reproduce_quick_writes_every_part",
    "tests/test_results_file.py::test_a_read_error_is_one_line",
    "tests/test_results_file.py::test_a_resumed_run_that_stops_keeps_what_it_finished",
    "tests/test_results_file.py::test_batch_lines_resume_by_custom_id",
    "tests/test_results_file.py::test_resume_serves_only_the_requests_not_in_the_output",
    "tests/test_results_file.py::test_resume_drops_damaged_output_lines_and_serves_them_again",
    "tests/test_results_file.py::test_resume_refuses_a_request_file_with_a_repeated_id",
    "tests/test_results_file.py::test_resume_drops_a_stray_line_with_nothing_to_serve",
    "tests/test_request_files.py::test_a_request_file_is_read_as_a_stream",
    "tests/test_request_files.py::test_a_request_file_is_served_in_order_through_the_store",
    "tests/test_request_files.py::test_openai_batch_lines_are_served_as_vllm_run_batch_does",
    "tests/test_scratch.py::test_a_sigkilled_run_leaves_nothing_after_the_next_start",
    "tests/test_scoring.py::test_a_long_scored_prompt_with_n_4_stalls_no_one",
    "tests/test_openai_server.py::test_bench_serve_quick_compares_three_policies",
    "tests/test_openai_server.py::test_load_every_request_answered_or_rejected_and_the_store_reopens",
    "tests/test_openai_server.py::test_sigterm_drains_in_flight_requests_and_the_next_server_reuses_the_store",
    "tests/test_serve_guard.py::test_abuse_harness_quick_passes_every_class",
    "tests/test_serve_guard.py::test_keys_and_salts_reach_the_engine_as_namespaces",
    "tests/test_serve_guard.py::test_a_right_and_a_wrong_guess_of_a_stored_prompt_get_the_same_usage",
    "tests/test_serve_guard.py::test_more_half_sent_connections_than_descriptors_leave_the_server_answering",
    "tests/test_serve_guard.py::test_stats_block_only_with_the_flag_and_cached_tokens_with_a_flag_or_a_salt",
    "tests/test_shared_pool.py::test_second_process_serves_the_prefix_from_the_pool_bit_exact",
    "tests/test_shared_pool.py::test_slow_pool_is_skipped_by_the_budget",
    "tests/test_shared_pool.py::test_a_pool_without_a_secret_is_used_but_never_becomes_local_state",
    "tests/test_prefix_store.py::test_store_survives_restart_in_a_new_process",
    "tests/test_store_tenancy.py::test_a_small_disk_keeps_metadata_room_and_stores_every_prefix",
    "tests/test_service_config.py::test_a_bad_url_from_the_command_line_is_refused_before_anything_loads",
    "tests/test_service_config.py::test_a_plan_that_needs_the_cost_model_is_calibrated_at_start",
    "tests/test_service_config.py::test_a_pool_without_a_secret_is_a_warning_at_start",
    "tests/test_service_config.py::test_run_plan_recompute_reaches_the_engine",
    "tests/test_service_config.py::test_the_workload_summary_counts_plans",
    "tests/test_weights.py::test_a_damaged_cached_tokenizer_is_rebuilt",
    "tests/test_tokenizer_stand_in.py::test_the_exported_directory_gives_the_ggufs_ids_without_the_gguf",
    "tests/test_optional_imports.py::test_the_gpu_checks_modules_import_without_the_optional_packages",
    "tests/test_optional_imports.py::test_the_remote_tier_says_redis_is_missing_in_one_line",
    "tests/test_optional_imports.py::test_the_server_says_its_stack_is_missing_before_loading_a_model",
    "tests/test_gpu_check.py::test_dry_run_starts_everything_from_the_image_and_the_kit",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path, _, name = item.nodeid.partition("::")
        if path in SLOW_MODULES or f"{path}::{name.split('[')[0]}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_opt_checkpoint(tmp_path_factory):
    """A seeded random OPT saved as a Hugging Face checkpoint (no tokenizer files)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(1234)
    config = OPTConfig(vocab_size=50272, hidden_size=64, num_hidden_layers=2, ffn_dim=256,
                       num_attention_heads=4, max_position_embeddings=512,
                       word_embed_proj_dim=64, do_layer_norm_before=True)
    path = tmp_path_factory.mktemp("hf-opt-tiny")
    OPTForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory):
    """A seeded random grouped-query Llama saved as a Hugging Face checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4321)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=10000.0,
                         tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("hf-llama-tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def offload_dir(tmp_path):
    d = tmp_path / "offload"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def tiny_runtimes(tmp_path_factory):
    """opt-tiny and llama-tiny runtimes (seeded random weights), closed after the module."""
    from impress_flexgen.runtime import Runtime, RuntimeConfig

    off = tmp_path_factory.mktemp("off")
    rts = {m: Runtime(RuntimeConfig(model=m, offload_dir=str(off))) for m in ("opt-tiny", "llama-tiny")}
    yield rts
    for rt in rts.values():
        rt.close()
