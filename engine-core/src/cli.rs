//! `harrier engine-core`: options, model loading, and the process's start and exit.

use std::path::PathBuf;

use anyhow::{bail, Context};
use harrier_shared::endpoint::{default_engine_endpoint, private_socket_dir, Endpoint};
use harrier_shared::protocol::{EngineInfo, EngineLimits, PROTOCOL_VERSION};

use crate::config::{EngineConfig, PipelineDepth};
use crate::engine::{EngineCore, ModelFacts};
use crate::executor::cpu::{CpuExecutor, CpuExecutorConfig};
use crate::model::{CpuModel, KvCache, ModelDir};
use crate::server::{serve, ServerOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// CUDA when a GPU and libcuda are present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, clap::Args)]
pub struct EngineCoreArgs {
    /// Hugging Face model directory, or a Hub model id (`ORG/NAME`, fetched into the Hugging
    /// Face cache; HF_ENDPOINT, HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply). Default: the embedded
    /// `harrier-cpu` model (written under $HARRIER_HOME/models on first use).
    #[arg(long, env = "HARRIER_MODEL")]
    pub model: Option<PathBuf>,
    /// Hub models: the branch, tag or commit to fetch (default `main`).
    #[arg(long, env = "HARRIER_REVISION")]
    pub revision: Option<String>,
    /// Name the model is served as (default: the directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to bind: `ipc:///path/engine.sock` or `tcp://127.0.0.1:PORT`.
    /// Default: `engine.sock` in the private socket directory.
    #[arg(long, env = "HARRIER_ENGINE_ENDPOINT")]
    pub endpoint: Option<Endpoint>,
    /// Private (0700) directory for ipc sockets.
    #[arg(long, env = "HARRIER_SOCKET_DIR")]
    pub socket_dir: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: u32,
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: u32,
    /// Default: the model's max_position_embeddings, capped by the KV cache.
    #[arg(long)]
    pub max_model_len: Option<u32>,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV cache size on the CPU, in MiB (ignored when --num-kv-blocks is given).
    #[arg(long, default_value_t = 1024)]
    pub kv_cache_mib: u64,
    #[arg(long)]
    pub num_kv_blocks: Option<u32>,
    /// Run the synchronous loop (one step in flight) instead of the 2-deep pipeline.
    #[arg(long)]
    pub sync: bool,
    #[arg(long, default_value_t = 20)]
    pub max_logprobs: u32,
    /// Turn off prefix caching (reuse of KV blocks shared with earlier requests).
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Keep full KV in every layer of a sliding-window model (Gemma 3) instead of giving its
    /// sliding layers a window-sized pool of their own (vLLM's flag of the same name).
    #[arg(long)]
    pub disable_hybrid_kv_cache_manager: bool,
    /// Which work gets each step's token budget first.
    #[arg(long, value_enum, default_value_t = crate::scheduler::SchedulingPolicy::DecodeFirst)]
    pub scheduling_policy: crate::scheduler::SchedulingPolicy,
    /// Compute threads for the CPU backend (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// CUDA backend: fraction of the device's memory for weights, activations and KV cache.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// CUDA backend: never capture or replay CUDA graphs (every step launches its kernels).
    #[arg(long)]
    pub enforce_eager: bool,
    /// CUDA backend: decode batch sizes to capture graphs for, comma-separated (default: 1, 2,
    /// 4, 8, 16, 24, 32, then steps of 16 up to --max-num-seqs). Larger batches run eagerly.
    #[arg(long, value_delimiter = ',')]
    pub cuda_graph_sizes: Option<Vec<usize>>,
    /// CUDA backend (bf16): decode steps of up to this many tokens run the fused small-batch
    /// path (skinny tensor-core GEMMs with RMSNorm, residual adds and the gated activation
    /// folded in; docs/cuda.md); 0 runs every step through cuBLAS and separate kernels. The
    /// default, 16, is where it was measured to win (docs/benchmarks.md, sessions 12 and 39):
    /// 9-16 rows only on models up to 2,048 wide, models up to 3,072 wide up to 8 rows, wider
    /// ones at one row; FP8 weights take the fusions up to 8 rows (4 on models wider than
    /// 2,048; docs/cuda.md).
    #[arg(long, default_value_t = crate::config::FUSED_DECODE_MAX_ROWS)]
    pub fused_decode_max_rows: usize,
    /// CUDA backend (bf16, sm_90): batch-1 decode steps of Llama-shaped models run as one
    /// persistent launch whose weights stream through a shared-memory ring (docs/cuda.md, "The
    /// decode ring"); it keeps transposed copies of the o and down projections (a quarter of
    /// the weights' bytes more). `auto`: where those copies take at most 1/16 of the device's
    /// memory (measured on an H200, session 23: the 8B ~10% faster, the 3B 6.4%, the 1B 2.5%).
    #[arg(long, value_enum, default_value_t = DecodeRing::Auto)]
    pub decode_ring: DecodeRing,
    /// Weight quantization at load. `fp8`: the layers' projections and the output head as
    /// e4m3 with one scale per output channel; activations bf16 in small decode steps and e4m3
    /// per token in larger ones on sm_89+ (CUDA, bf16 only; docs/fp8.md). On the CPU backend the weights are rounded to those FP8 values and kept
    /// in f32: an accuracy model of the CUDA path, not a speedup. Checkpoints that are FP8
    /// already (a `quantization_config` of compressed-tensors, fbgemm_fp8 or fp8) need no flag.
    #[arg(long, value_enum)]
    pub quantization: Option<Quantization>,
    /// CUDA backend: storage type of weights, activations and KV cache. `auto` is bfloat16
    /// (the serving type); float32 is exact fp32 (twice the memory; for accuracy checks).
    /// The CPU backend always computes in fp32.
    #[arg(long, value_enum, default_value_t = ModelDtype::Auto)]
    pub dtype: ModelDtype,
    /// Speculative decoding with this draft model (a directory or Hub id) sharing the target's
    /// vocabulary and tokenizer.
    #[arg(long, env = "HARRIER_SPECULATIVE_MODEL")]
    pub speculative_model: Option<PathBuf>,
    /// How speculative decoding proposes tokens: `draft` (the --speculative-model; the
    /// default when one is given) or `ngram` (prompt lookup, no model). Off when neither a
    /// method nor a model is given.
    #[arg(long, value_enum)]
    pub speculative_method: Option<crate::spec::SpecMethod>,
    /// Tokens proposed per round (K); a round emits 1 to K + 1 tokens.
    #[arg(long, default_value_t = 4)]
    pub num_speculative_tokens: u32,
    /// N-gram proposer: the shortest suffix looked up.
    #[arg(long, default_value_t = 1)]
    pub ngram_min: usize,
    /// N-gram proposer: the longest suffix looked up.
    #[arg(long, default_value_t = 4)]
    pub ngram_max: usize,
    /// Speculative decoding: rounds propose nothing while more than this many requests are
    /// decoding (large decode batches gain nothing from it; docs/speculative.md). Default:
    /// always speculate.
    #[arg(long)]
    pub speculative_disable_by_batch_size: Option<u32>,
}

/// What `--speculative-*` ask for, checked.
#[derive(Debug, Clone, PartialEq)]
pub enum SpecChoice {
    Off,
    Draft { model: PathBuf, k: u32 },
    Ngram { min: usize, max: usize, k: u32 },
}

impl EngineCoreArgs {
    /// Reads and checks the speculative decoding options.
    pub fn spec_choice(&self) -> anyhow::Result<SpecChoice> {
        use crate::spec::SpecMethod;
        let k = self.num_speculative_tokens;
        let method = match (self.speculative_method, &self.speculative_model) {
            (None, None) => return Ok(SpecChoice::Off),
            (Some(m), _) => m,
            (None, Some(_)) => SpecMethod::Draft,
        };
        let max_k = crate::scheduler::MAX_SPECULATIVE_TOKENS;
        if k == 0 || k as usize > max_k {
            bail!("--num-speculative-tokens must be between 1 and {max_k}, got {k}");
        }
        match method {
            SpecMethod::Draft => match &self.speculative_model {
                Some(model) => Ok(SpecChoice::Draft {
                    model: model.clone(),
                    k,
                }),
                None => bail!("--speculative-method draft needs --speculative-model DIR"),
            },
            SpecMethod::Ngram => {
                if self.speculative_model.is_some() {
                    bail!("--speculative-method ngram takes no --speculative-model");
                }
                if self.ngram_min == 0 || self.ngram_min > self.ngram_max {
                    bail!(
                        "--ngram-min ({}) must be at least 1 and at most --ngram-max ({})",
                        self.ngram_min,
                        self.ngram_max
                    );
                }
                Ok(SpecChoice::Ngram {
                    min: self.ngram_min,
                    max: self.ngram_max,
                    k,
                })
            }
        }
    }
}

/// `--decode-ring` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DecodeRing {
    Auto,
    On,
    Off,
}

/// `--quantization` values (vLLM's spelling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Quantization {
    Fp8,
}

/// `--dtype` values (vLLM's spelling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelDtype {
    Auto,
    Bfloat16,
    Float32,
}

impl EngineCoreArgs {
    /// The decode graph sizes these options ask for (empty with --enforce-eager).
    pub fn graph_sizes(&self) -> Vec<usize> {
        if self.enforce_eager {
            return Vec::new();
        }
        match &self.cuda_graph_sizes {
            Some(v) => v.clone(),
            None => crate::config::default_graph_sizes(self.max_num_seqs as usize),
        }
    }
}

impl EngineCoreArgs {
    /// The defaults of every option (environment variables ignored).
    pub fn defaults() -> Self {
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: EngineCoreArgs,
        }
        let mut args = <Wrapper as clap::Parser>::parse_from(["harrier"]).args;
        args.model = None;
        args.endpoint = None;
        args.socket_dir = None;
        args
    }
}

/// Where the embedded default model lives: `$HARRIER_HOME/models/harrier-cpu`.
pub fn default_model_dir() -> PathBuf {
    crate::default_model::dir_in(&crate::gen_model::harrier_home().join("models"))
}

/// Returns the embedded default model (`harrier-cpu`, see [`crate::default_model`]), writing
/// its files under `$HARRIER_HOME/models` on first use (or when they came from another
/// binary). The copy is made in a private directory renamed into place, so concurrent starts
/// never see half a model.
pub fn ensure_default_model() -> anyhow::Result<PathBuf> {
    crate::default_model::ensure_in(&crate::gen_model::harrier_home().join("models"))
}

/// A model directory to load, and the Hub id it came from (the default served name).
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    pub dir: PathBuf,
    pub hub_id: Option<String>,
}

/// What `--model` names: nothing (the embedded default), a local directory, or a Hub model id
/// (fetched into the Hugging Face cache, or found there; [`crate::hub`]).
pub fn resolve_model(
    model: Option<&std::path::Path>,
    revision: Option<&str>,
) -> anyhow::Result<ResolvedModel> {
    let Some(path) = model else {
        if revision.is_some() {
            bail!("--revision needs a Hub model id in --model");
        }
        return Ok(ResolvedModel {
            dir: ensure_default_model()?,
            hub_id: None,
        });
    };
    match path.to_str() {
        Some(id) if crate::hub::is_hub_id(id) => {
            let m = crate::hub::fetch(&crate::hub::HubConfig::from_env(), id, revision)?;
            Ok(ResolvedModel {
                dir: m.dir,
                hub_id: Some(m.repo_id),
            })
        }
        _ if revision.is_some() => bail!(
            "--revision applies to Hub model ids; {} is a local path",
            path.display()
        ),
        _ => Ok(ResolvedModel {
            dir: path.to_path_buf(),
            hub_id: None,
        }),
    }
}

/// A ready engine with its handshake answer.
pub struct BuiltEngine<E: crate::executor::Executor = CpuExecutor> {
    pub engine: EngineCore<E>,
    pub info: EngineInfo,
}

/// The model's context length, or `--max-model-len` if it fits the model.
fn model_len_limit(args: &EngineCoreArgs, mc: &crate::model::ModelConfig) -> anyhow::Result<u32> {
    match args.max_model_len {
        Some(n) if n as usize > mc.max_position_embeddings => bail!(
            "--max-model-len {n} exceeds the model's max_position_embeddings ({})",
            mc.max_position_embeddings
        ),
        Some(n) => Ok(n),
        None => Ok(mc.max_position_embeddings as u32),
    }
}

/// The validated engine configuration once the KV pool size is known. Without an explicit
/// `--max-model-len` the context is capped by what the pool can hold.
fn engine_config(
    args: &EngineCoreArgs,
    model_len: u32,
    num_kv_blocks: u32,
    num_speculative_tokens: u32,
    local_kv: Option<crate::scheduler::LocalKvConfig>,
) -> anyhow::Result<EngineConfig> {
    let kv_tokens = num_kv_blocks.saturating_sub(1) * args.block_size;
    let cfg = EngineConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: if args.max_model_len.is_some() {
            model_len
        } else {
            model_len.min(kv_tokens.saturating_sub(num_speculative_tokens))
        },
        block_size: args.block_size,
        num_kv_blocks,
        pipeline: if args.sync {
            PipelineDepth::Sync
        } else {
            PipelineDepth::Async
        },
        max_logprobs: args.max_logprobs,
        enable_prefix_caching: !args.no_prefix_caching,
        policy: args.scheduling_policy,
        num_speculative_tokens,
        spec_disable_batch_size: args.speculative_disable_by_batch_size,
        local_kv,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The sliding layers' window when they get a window-sized KV pool of their own: the model
/// has sliding layers and full ones, and neither the flag nor speculative decoding turns it
/// off (a model whose layers all slide keeps one pool).
fn hybrid_window(
    args: &EngineCoreArgs,
    mc: &crate::model::ModelConfig,
    speculating: bool,
) -> Option<u32> {
    let s = mc.sliding.as_ref()?;
    let mixed = (1..mc.num_layers).contains(&mc.num_sliding_layers());
    if !mixed || args.disable_hybrid_kv_cache_manager {
        return None;
    }
    if speculating {
        tracing::warn!("speculative decoding keeps full KV in the sliding-window layers (window-sized KV does not combine with it yet)");
        return None;
    }
    u32::try_from(s.window).ok()
}

/// Blocks of the sliding layers' pool: every running request's window (at most the model
/// length) plus the two blocks a misaligned window and its next token straddle, one step's
/// worth of chunk tokens, and the scratch block. With that much the local pool never limits
/// the batch; the scheduler copes with less (chunks shrink, preemption).
fn local_pool_demand(args: &EngineCoreArgs, window: u32, model_len: u32) -> u32 {
    let bs = args.block_size;
    let per_request = window.min(model_len.max(1)).div_ceil(bs) + 2;
    args.max_num_seqs
        .saturating_mul(per_request)
        .saturating_add(args.max_num_batched_tokens.div_ceil(bs) + 1)
}

/// The start-up line of a hybrid KV cache: both pools' sizes.
fn log_kv_pools(
    full_blocks: u32,
    full_tokens: u64,
    full_bytes: u64,
    local: crate::scheduler::LocalKvConfig,
    local_bytes: u64,
) {
    tracing::info!(
        full_layers_kv_blocks = full_blocks,
        full_layers_kv_tokens = full_tokens,
        full_layers_kv_mib = full_bytes >> 20,
        sliding_layers_kv_blocks = local.num_blocks,
        sliding_window = local.window,
        sliding_layers_kv_mib = local_bytes >> 20,
        "KV capacity per attention type: the sliding-window layers keep window-sized KV in a pool of their own"
    );
}

/// Wraps a backend into an engine and the handshake answer front ends receive.
fn finish_engine<E: crate::executor::Executor>(
    args: &EngineCoreArgs,
    dir: &ModelDir,
    cfg: EngineConfig,
    exec: E,
) -> anyhow::Result<BuiltEngine<E>> {
    let mc = &dir.config;
    let facts = ModelFacts {
        vocab_size: mc.vocab_size as u32,
        eos_token_ids: dir.generation.eos_token_ids.clone(),
    };
    let info = EngineInfo {
        protocol_version: PROTOCOL_VERSION,
        engine_version: env!("CARGO_PKG_VERSION").to_string(),
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| dir.name.clone()),
        max_model_len: cfg.max_model_len,
        vocab_size: mc.vocab_size as u32,
        eos_token_ids: facts.eos_token_ids.clone(),
        limits: EngineLimits {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_logprobs: cfg.max_logprobs,
            block_size: cfg.block_size,
            num_kv_blocks: cfg.num_kv_blocks,
            num_speculative_tokens: cfg.num_speculative_tokens,
        },
    };
    let mut engine = EngineCore::new(cfg, facts, exec)?;
    // Structured outputs need the vocabulary as bytes: from the model's tokenizer.json.
    let tokenizer = dir.path.join("tokenizer.json");
    if tokenizer.is_file() {
        let started = std::time::Instant::now();
        match crate::structured::GrammarCompiler::from_tokenizer_json(
            &tokenizer,
            mc.vocab_size,
            &dir.generation.eos_token_ids,
        ) {
            Ok(c) => {
                tracing::info!(
                    ms = started.elapsed().as_millis() as u64,
                    "structured outputs ready (llguidance token trie built)"
                );
                engine.enable_structured_outputs(std::sync::Arc::new(c));
            }
            Err(e) => tracing::warn!("structured outputs off: {e:#}"),
        }
    } else {
        tracing::info!("structured outputs off: the model directory has no tokenizer.json");
    }
    Ok(BuiltEngine { engine, info })
}

/// Loads the model and builds the CPU engine described by `args`.
pub fn build_cpu_engine(
    args: &EngineCoreArgs,
    model_dir: &std::path::Path,
) -> anyhow::Result<BuiltEngine> {
    use crate::executor::cpu::CpuProposer;
    let dir = ModelDir::open(model_dir)
        .with_context(|| format!("opening model directory {}", model_dir.display()))?;
    let mc = &dir.config;
    let spec = args.spec_choice()?;
    let started = std::time::Instant::now();
    let opts = crate::model::LoadOptions {
        round_fp8: args.quantization == Some(Quantization::Fp8),
    };
    if opts.round_fp8 {
        tracing::warn!(
            "--quantization fp8 on the CPU backend: weights are rounded to their FP8 values and \
             computed in f32 (an accuracy model of the CUDA path; no memory or speed gain)"
        );
    }
    let model = CpuModel::load_with(&dir, opts)
        .with_context(|| format!("loading weights from {}", model_dir.display()))?;
    let target_bpb = KvCache::bytes_per_block(mc, args.block_size as usize) as u64;
    let (proposer, draft_bpb, k) = match &spec {
        SpecChoice::Off => (None, 0, 0),
        SpecChoice::Ngram { min, max, k } => (
            Some(CpuProposer::Ngram {
                min: *min,
                max: *max,
            }),
            0,
            *k,
        ),
        SpecChoice::Draft { model: draft, k } => {
            let draft = resolve_model(Some(draft), None)?;
            let ddir = ModelDir::open(&draft.dir).with_context(|| {
                format!("opening the draft model directory {}", draft.dir.display())
            })?;
            crate::spec::check_draft(&dir, &ddir)?;
            let dmodel = CpuModel::load(&ddir).with_context(|| {
                format!("loading the draft's weights from {}", ddir.path.display())
            })?;
            let bpb = KvCache::bytes_per_block(&ddir.config, args.block_size as usize) as u64;
            (Some(CpuProposer::Draft(Box::new(dmodel))), bpb, *k)
        }
    };
    let model_len = model_len_limit(args, mc)?;
    // Sliding layers in a pool of their own: its blocks cost only those layers' bytes, and
    // the full pool's blocks only the full layers'.
    let window = hybrid_window(args, mc, k > 0);
    let budget = args.kv_cache_mib << 20;
    let (target_bpb, local_kv) = match window {
        None => (target_bpb, None),
        Some(w) => {
            let local_bpb = KvCache::bytes_per_local_block(mc, args.block_size as usize) as u64;
            let least = crate::scheduler::LocalKvConfig::min_blocks(w, args.block_size);
            let blocks = match args.num_kv_blocks {
                Some(_) => local_pool_demand(args, w, model_len),
                // At most half the budget when the budget is what sizes the pools.
                None => local_pool_demand(args, w, model_len)
                    .min(((budget / 2) / local_bpb.max(1)).min(u32::MAX as u64) as u32)
                    .max(least),
            };
            (
                KvCache::bytes_per_full_block(mc, args.block_size as usize) as u64,
                Some(crate::scheduler::LocalKvConfig {
                    window: w,
                    num_blocks: blocks,
                }),
            )
        }
    };
    let local_bytes = local_kv.map_or(0, |l| {
        l.num_blocks as u64 * KvCache::bytes_per_local_block(mc, args.block_size as usize) as u64
    });
    // The draft's KV shares the target's block ids: one block costs both.
    let bytes_per_block = target_bpb + draft_bpb;
    let num_kv_blocks = match args.num_kv_blocks {
        Some(n) => n,
        None => (budget.saturating_sub(local_bytes) / bytes_per_block).min(u32::MAX as u64) as u32,
    };
    let cfg = engine_config(args, model_len, num_kv_blocks, k, local_kv)?;
    let (max_model_len, kv_tokens) = (cfg.max_model_len, (num_kv_blocks - 1) * args.block_size);
    tracing::info!(
        model = %dir.name,
        load_s = format!("{:.2}", started.elapsed().as_secs_f64()),
        kv_blocks = num_kv_blocks,
        kv_tokens,
        kv_mib = (num_kv_blocks as u64 * bytes_per_block) >> 20,
        max_model_len,
        pipeline = ?cfg.pipeline,
        "CPU engine configured"
    );
    if let Some(l) = local_kv {
        let full_bytes = num_kv_blocks as u64 * bytes_per_block;
        log_kv_pools(num_kv_blocks, kv_tokens as u64, full_bytes, l, local_bytes);
    }
    match &spec {
        SpecChoice::Off => {}
        SpecChoice::Draft { model, k } => tracing::info!(
            draft = %model.display(),
            k,
            target_kv_mib = (num_kv_blocks as u64 * target_bpb) >> 20,
            draft_kv_mib = (num_kv_blocks as u64 * draft_bpb) >> 20,
            "speculative decoding with a draft model (the KV budget split by bytes per block; draft prefill runs beside the target's)"
        ),
        SpecChoice::Ngram { min, max, k } => tracing::info!(
            k,
            ngram_min = min,
            ngram_max = max,
            "speculative decoding with n-gram prompt lookup"
        ),
    }
    let exec = CpuExecutor::new(
        model,
        mc,
        CpuExecutorConfig {
            num_kv_blocks,
            num_local_kv_blocks: local_kv.map(|l| l.num_blocks),
            block_size: args.block_size,
            max_rows: args.max_num_seqs,
        },
        proposer,
    )?;
    finish_engine(args, &dir, cfg, exec)
}

/// Loads the model onto the GPU and builds the CUDA engine described by `args`.
#[cfg(feature = "cuda")]
pub fn build_cuda_engine(
    args: &EngineCoreArgs,
    model_dir: &std::path::Path,
) -> anyhow::Result<BuiltEngine<crate::executor::cuda::CudaExecutor>> {
    use crate::executor::cuda::{CudaExecutor, CudaExecutorConfig};
    let dir = ModelDir::open(model_dir)
        .with_context(|| format!("opening model directory {}", model_dir.display()))?;
    let mc = &dir.config;
    use crate::executor::cuda::{CudaProposer, CudaSpecConfig};
    let speculative = match args.spec_choice()? {
        SpecChoice::Off => None,
        SpecChoice::Draft { model, k } => Some(CudaSpecConfig {
            proposer: CudaProposer::Draft(resolve_model(Some(&model), None)?.dir),
            k: k as usize,
        }),
        SpecChoice::Ngram { min, max, k } => Some(CudaSpecConfig {
            proposer: CudaProposer::Ngram { min, max },
            k: k as usize,
        }),
    };
    let k = speculative.as_ref().map_or(0, |s| s.k as u32);
    let started = std::time::Instant::now();
    let max_model_len = model_len_limit(args, mc)?;
    let window = hybrid_window(args, mc, speculative.is_some());
    let (exec, start) = CudaExecutor::new(
        &dir,
        &CudaExecutorConfig {
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_model_len,
            block_size: args.block_size,
            num_kv_blocks: args.num_kv_blocks,
            gpu_memory_utilization: args.gpu_memory_utilization,
            device: 0,
            graph_sizes: args.graph_sizes(),
            dtype: match args.dtype {
                ModelDtype::Auto | ModelDtype::Bfloat16 => harrier_kernels::Dtype::Bf16,
                ModelDtype::Float32 => harrier_kernels::Dtype::F32,
            },
            local_kv_blocks: window.map(|w| local_pool_demand(args, w, max_model_len)),
            fused_max_rows: args.fused_decode_max_rows,
            decode_ring: match args.decode_ring {
                DecodeRing::Auto => None,
                DecodeRing::On => Some(true),
                DecodeRing::Off => Some(false),
            },
            fp8: args.quantization == Some(Quantization::Fp8),
            speculative,
        },
    )
    .with_context(|| format!("starting the CUDA backend for {}", model_dir.display()))?;
    let num_kv_blocks = start.kv_blocks;
    let local_kv =
        window
            .zip(start.local_kv_blocks)
            .map(|(window, blocks)| crate::scheduler::LocalKvConfig {
                window,
                // The executor's count leaves out its padding scratch block; the scheduler's pool
                // reserves its own block 0 as scratch, which the executor's pool also has.
                num_blocks: blocks,
            });
    let cfg = engine_config(args, max_model_len, num_kv_blocks, k, local_kv)?;
    let max_model_len = cfg.max_model_len;
    tracing::info!(
        model = %dir.name,
        device = %start.device_name,
        arch = start.arch,
        dtype = start.dtype.name(),
        load_s = format!("{:.2}", started.elapsed().as_secs_f64()),
        weights_mib = start.weight_bytes >> 20,
        activations_mib = start.activation_bytes >> 20,
        kv_blocks = num_kv_blocks,
        kv_tokens = start.kv_tokens,
        kv_mib = start.kv_bytes >> 20,
        kernels_cached = start.kernels_from_cache,
        pdl = start.pdl,
        fp8_gemm = start.fp8_gemm,
        decode_ring = start.decode_ring,
        cuda_graphs = start.graph_count,
        graph_sizes = ?start.graph_sizes,
        graph_capture_ms = format!("{:.0}", start.graph_capture_ms),
        graph_mib = format!("{:.1}", start.graph_bytes as f64 / (1u64 << 20) as f64),
        max_model_len,
        pipeline = ?cfg.pipeline,
        "CUDA engine configured"
    );
    if let Some(l) = local_kv {
        let (full, local) = (start.kv_bytes as u64, start.local_kv_bytes as u64);
        log_kv_pools(num_kv_blocks, start.kv_tokens, full, l, local);
    }
    finish_engine(args, &dir, cfg, exec)
}

/// Whether a CUDA device is usable: libcuda loads (cudarc's library-presence check, no panic)
/// and reports a device.
pub fn cuda_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::executor::cuda::cuda_present()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Why `--device cuda` cannot run, in one line (`None`: it can).
fn cuda_unavailable() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        crate::executor::cuda::cuda_unavailable_reason()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Some("this build has no CUDA backend (feature `cuda` off)".into())
    }
}

/// The `engine-core` subcommand: runs until SIGTERM/SIGINT (exit 0) or a fatal error (non-zero).
pub fn run_engine_core(mut args: EngineCoreArgs) -> anyhow::Result<()> {
    let use_cuda = match args.device {
        Device::Cuda => match cuda_unavailable() {
            Some(why) => bail!("--device cuda: {why}; use --device cpu"),
            None => true,
        },
        Device::Auto => cuda_present() && cuda_unavailable().is_none(),
        Device::Cpu => false,
    };
    let model = resolve_model(args.model.as_deref(), args.revision.as_deref())?;
    if args.served_model_name.is_none() {
        args.served_model_name = model.hub_id.clone();
    }
    #[cfg(feature = "cuda")]
    if use_cuda {
        let built = build_cuda_engine(&args, &model.dir)?;
        return serve_built(built, &args);
    }
    let _ = use_cuda;
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("configuring compute threads")?;
    }
    let built = build_cpu_engine(&args, &model.dir)?;
    serve_built(built, &args)
}

/// Serves a built engine on its endpoint until a signal or a fatal error.
fn serve_built<E: crate::executor::Executor + Send + 'static>(
    built: BuiltEngine<E>,
    args: &EngineCoreArgs,
) -> anyhow::Result<()> {
    let endpoint = match &args.endpoint {
        Some(e) => e.clone(),
        None => default_engine_endpoint(&private_socket_dir(args.socket_dir.as_deref())?),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the I/O runtime")?;
    rt.block_on(serve(
        built.engine,
        built.info,
        &endpoint,
        ServerOptions::default(),
        shutdown_signal(),
    ))
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop the engine with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_sizes_follow_the_options() {
        let mut a = EngineCoreArgs::defaults();
        a.max_num_seqs = 64;
        assert_eq!(a.graph_sizes(), [1, 2, 4, 8, 16, 24, 32, 48, 64]);
        a.cuda_graph_sizes = Some(vec![4, 1]);
        assert_eq!(a.graph_sizes(), [4, 1]);
        a.enforce_eager = true;
        assert!(a.graph_sizes().is_empty());
        // The flags parse as documented.
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: EngineCoreArgs,
        }
        let w = <Wrapper as clap::Parser>::parse_from(["h", "--cuda-graph-sizes", "1,2,8"]);
        assert_eq!(w.args.cuda_graph_sizes, Some(vec![1, 2, 8]));
        assert!(!w.args.enforce_eager);
        assert_eq!(w.args.dtype, ModelDtype::Auto);
        let w = <Wrapper as clap::Parser>::parse_from(["h", "--dtype", "float32"]);
        assert_eq!(w.args.dtype, ModelDtype::Float32);
        assert!(<Wrapper as clap::Parser>::try_parse_from(["h", "--dtype", "fp8"]).is_err());
    }
}
