"""llama.cpp's pre-tokenizer facts (no torch): its test text and the table of token-id hashes it keys names by, the
Hugging Face split regexes of the families strop handles with the names that apply each, and one name per
distinct behaviour of its BPE pre-tokenizer.

Detection (:mod:`strop.common.pretokenizers`) reads these; the proof with llama.cpp (:mod:`strop.common.gguf_pretok`)
tries :data:`BEHAVIOURS`. Taken from llama.cpp: ``convert_hf_to_gguf.py`` / ``conversion/base.py``
(``get_vocab_base_pre``), ``convert_hf_to_gguf_update.py`` (``CHK_TXT``) and ``src/llama-vocab.cpp``
(``llm_tokenizer_bpe``, ``llama_vocab::impl::load``), as vendored in llama-cpp-python 0.3.36.
"""

from __future__ import annotations

# llama.cpp's test text (convert_hf_to_gguf_update.py, CHK_TXT): whitespace runs, emoji with a ZWJ, digit
# runs, Khmer, CJK, Cyrillic, quote and punctuation runs, contractions in every case.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256(str(tokenizer.encode(CHKTXT))) → llama.cpp's name, from get_vocab_base_pre (the reference
# checkpoint in the comment). The converter tests them in this order and the last match wins; a dict built
# from this list keeps that rule for the two hashes listed twice.
_CHKHSH_ROWS: tuple[tuple[str, str, str], ...] = (
    (
        "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b",
        "chatglm-bpe",
        "THUDM/glm-4-9b-chat",
    ),
    (
        "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516",
        "chatglm-bpe",
        "THUDM/glm-4-9b-chat",
    ),
    ("a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2", "glm4", "THUDM/glm-4-9b-hf"),
    ("9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902", "glm4", "zai-org/GLM-4.5-Air"),
    (
        "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35",
        "minerva-7b",
        "sapienzanlp/Minerva-7B-base-v1.0",
    ),
    (
        "7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664",
        "hunyuan",
        "tencent/Hunyuan-A13B-Instruct",
    ),
    (
        "bba3b3366b646dbdded5dbc42d59598b849371afc42f7beafa914afaa5b70aa6",
        "hunyuan-dense",
        "tencent/Hunyuan-4B-Instruct",
    ),
    (
        "a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6",
        "falcon-h1",
        "tiiuae/Falcon-H1-0.5B-Base",
    ),
    (
        "60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86",
        "falcon-h1",
        "tiiuae/Falcon-H1-1B-Base",
    ),
    (
        "3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896",
        "falcon-h1",
        "tiiuae/Falcon-H1-7B-Base",
    ),
    (
        "48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b",
        "falcon-h1",
        "tiiuae/Falcon-H1-34B-Base",
    ),
    (
        "81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890",
        "kimi-k2",
        "moonshotai/Kimi-K2-Base",
    ),
    (
        "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c",
        "qwen2",
        "Qwen/Qwen3-Embedding-0.6B",
    ),
    (
        "66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273",
        "grok-2",
        "alvarobartt/grok-2-tokenizer",
    ),
    (
        "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5",
        "llama-bpe",
        "meta-llama/Meta-Llama-3-8B",
    ),
    (
        "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754",
        "deepseek-llm",
        "deepseek-ai/deepseek-llm-7b-base",
    ),
    (
        "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821",
        "deepseek-coder",
        "deepseek-ai/deepseek-coder-6.7b-base",
    ),
    ("8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed", "falcon", "tiiuae/falcon-7b"),
    (
        "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f",
        "bert-bge",
        "BAAI/bge-small-en-v1.5",
    ),
    ("9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e", "falcon3", "tiiuae/Falcon3-7B-Base"),
    (
        "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7",
        "bert-bge-large",
        "BAAI/bge-large-zh-v1.5",
    ),
    ("b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166", "mpt", "mosaicml/mpt-7b"),
    (
        "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34",
        "starcoder",
        "bigcode/starcoder2-3b",
    ),
    ("3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454", "gpt-2", "openai-community/gpt2"),
    (
        "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3",
        "stablelm2",
        "stabilityai/stablelm-2-zephyr-1_6b",
    ),
    (
        "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff",
        "refact",
        "smallcloudai/Refact-1_6-base",
    ),
    (
        "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8",
        "command-r",
        "CohereForAI/c4ai-command-r-v01",
    ),
    ("e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea", "qwen2", "Qwen/Qwen1.5-7B"),
    ("b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166", "olmo", "allenai/OLMo-1.7-7B-hf"),
    ("a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e", "dbrx", "databricks/dbrx-base"),
    (
        "c7699093ba4255a91e702aa38a596aa81669f3525dae06c2953267dde580f448",
        "jina-v1-en",
        "jinaai/jina-reranker-v1-tiny-en",
    ),
    (
        "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f",
        "jina-v2-en",
        "jinaai/jina-embeddings-v2-base-en",
    ),
    (
        "171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643",
        "jina-v2-es",
        "jinaai/jina-embeddings-v2-base-es",
    ),
    (
        "27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6",
        "jina-v2-de",
        "jinaai/jina-embeddings-v2-base-de",
    ),
    (
        "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d",
        "smaug-bpe",
        "abacusai/Smaug-Llama-3-70B-Instruct",
    ),
    (
        "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360",
        "poro-chat",
        "LumiOpen/Poro-34B-chat",
    ),
    (
        "7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a",
        "jina-v2-code",
        "jinaai/jina-embeddings-v2-base-code",
    ),
    ("7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee", "viking", "LumiOpen/Viking-7B"),
    ("b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901", "jais", "core42/jais-13b"),
    (
        "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f",
        "codeshell",
        "WisdomShell/CodeShell-7B",
    ),
    (
        "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e",
        "tekken",
        "mistralai/Mistral-Nemo-Base-2407",
    ),
    (
        "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249",
        "smollm",
        "HuggingFaceTB/SmolLM-135M",
    ),
    ("3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7", "bloom", "bigscience/bloom"),
    (
        "bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21",
        "gpt3-finnish",
        "TurkuNLP/gpt3-finnish-small",
    ),
    (
        "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae",
        "exaone",
        "LGAI-EXAONE/EXAONE-3.0-7.8B-Instruct",
    ),
    ("fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085", "phi-2", "microsoft/phi-2"),
    (
        "60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450",
        "chameleon",
        "facebook/chameleon-7b",
    ),
    (
        "8b5a93ed704057481f240da0be7e7dca721d7f8f4755263b6807227a2cbeae65",
        "roberta-bpe",
        "sentence-transformers/stsb-roberta-base",
    ),
    (
        "ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb",
        "gigachat",
        "ai-sage/GigaChat-20B-A3B-instruct",
    ),
    (
        "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1",
        "megrez",
        "Infinigence/Megrez-3B-Instruct",
    ),
    (
        "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5",
        "deepseek-v3",
        "deepseek-ai/DeepSeek-V3",
    ),
    (
        "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5",
        "deepseek-r1-qwen",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    ),
    ("ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e", "gpt-4o", "Xenova/gpt-4o"),
    (
        "7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f",
        "superbpe",
        "UW/OLMo2-8B-SuperBPE-t180k",
    ),
    (
        "1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15",
        "trillion",
        "trillionlabs/Trillion-7B-preview",
    ),
    (
        "96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224",
        "bailingmoe",
        "inclusionAI/Ling-lite",
    ),
    (
        "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406",
        "llama4",
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    ),
    (
        "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3",
        "pixtral",
        "mistral-community/pixtral-12b",
    ),
    (
        "d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec",
        "seed-coder",
        "ByteDance-Seed/Seed-Coder-8B-Base",
    ),
    ("b0a6b1c0bd5998ebd9df08611efde34a4ff03faed45ae09c43e6b31ebd4b94cf", "a.x-4.0", "skt/A.X-4.0"),
    (
        "f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4",
        "midm-2.0",
        "K-intelligence/Midm-2.0-Base-Instruct",
    ),
    ("169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51", "lfm2", "LiquidAI/LFM2-Tokenizer"),
    (
        "2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb",
        "exaone4",
        "LGAI-EXAONE/EXAONE-4.0-32B",
    ),
    (
        "a1e163ecab2e718a4c829d1148b6e86824ec36163bb71941c3dca9cd5ac25756",
        "mellum",
        "JetBrains/Mellum-4b-base",
    ),
    (
        "9b1be57e70d20d9501b2b3186e792d81181ae36ada3903c26f9fea418cf87206",
        "bailingmoe2",
        "inclusionAI/Ling-mini-base-2.0",
    ),
    (
        "53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e",
        "granite-docling",
        "ibm-granite/granite-docling-258M",
    ),
    (
        "f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95",
        "minimax-m2",
        "MiniMaxAI/MiniMax-M2",
    ),
)
CHKHSH: dict[str, str] = {h: name for h, name, _ in _CHKHSH_ROWS}

# The Hugging Face Split regexes of the families strop handles (as their tokenizer.json carries them; the
# "original regex from tokenizer.json" comments of llama-vocab.cpp) → llama.cpp names applying the same
# split, best first. llama.cpp rewrites ``(?i:…)`` and some classes for its regex engine; the behavioural
# check, not this table, decides whether the rewrite is exact for a given vocabulary.
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLIT_REGEX_NAMES: dict[str, tuple[str, ...]] = {
    # llama-bpe makes llama.cpp take a word that is a whole vocabulary entry without merging
    # (ignore_merges, as Llama 3's tokenizer.json asks); smaug-bpe is the same split with merges always.
    LLAMA3_REGEX: ("llama-bpe", "smaug-bpe"),
    QWEN2_REGEX: ("qwen2",),
    QWEN35_REGEX: ("qwen35",),
    TEKKEN_REGEX: ("tekken",),
    GPT4O_REGEX: ("gpt-4o",),
    SEED_CODER_REGEX: ("seed-coder",),
}

# One llama.cpp name per distinct behaviour of its BPE pre-tokenizer (regex set, ignore_merges), read from
# llama-vocab.cpp; names that only alias one of these (mpt, olmo, starcoder, stablelm2, deepseek-r1-qwen,
# falcon3, pixtral, llama4, …) select the same splitting and are not repeated. Tried in this order when the
# structure names no candidate, or none of its candidates reproduces HF.
BEHAVIOURS: tuple[str, ...] = (
    "gpt-2",
    "smollm",
    "llama-bpe",
    "smaug-bpe",
    "qwen2",
    "qwen35",
    "tekken",
    "gpt-4o",
    "seed-coder",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "falcon",
    "default",
    "bloom",
    "viking",
    "chameleon",
    "tiny_aya",
    "superbpe",
    "bailingmoe",
    "jais-2",
    "exaone-moe",
    "granite-embed-multi-97m",
    "minicpm5",
    "youtu",
    "ufakzeka",
    "spark2_5",
    "afmoe",
    "laguna",
)

SPM_PRE = "default"  # a SentencePiece vocabulary (tokenizer.ggml.model = llama) has no pre-tokenizer choice
