"""
Speech-LLM SFT: frozen Whisper encoder -> conv downsampler + MLP projector -> Qwen2 (LoRA).
Mixed ASR / spoken-QA / text-only instruction data so the LLM doesn't forget text chat.

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER:29400 \
    07_speech_llm_whisper_qwen.py --train_manifest data/mix_train.jsonl --bf16
"""
import argparse
import contextlib
import json
import math
import os
import random

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, WhisperFeatureExtractor, WhisperModel
from transformers import get_cosine_schedule_with_warmup

AUDIO_PLACEHOLDER = "<|audio|>"
IGNORE = -100


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--whisper", default="openai/whisper-large-v3")
    ap.add_argument("--llm", default="Qwen/Qwen2-7B-Instruct")
    ap.add_argument("--train_manifest", required=True)
    ap.add_argument("--out", default="ckpt/speech_llm")
    ap.add_argument("--bsz", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max_text_len", type=int, default=512)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--save_every", type=int, default=2000)
    return ap.parse_args()


class MixDataset(Dataset):
    """jsonl rows: {"audio": path or null, "prompt": str, "response": str}"""

    def __init__(self, manifest, tok, fe, max_len):
        self.rows = [json.loads(l) for l in open(manifest)]
        self.tok, self.fe, self.max_len = tok, fe, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        feats = None
        prompt = r["prompt"]
        if r.get("audio"):
            wav, sr = sf.read(r["audio"], dtype="float32")
            if wav.ndim > 1:
                wav = wav.mean(-1)
            feats = self.fe(wav[: sr * 30], sampling_rate=16000, return_tensors="pt").input_features[0]
            prompt = AUDIO_PLACEHOLDER + "\n" + prompt
        msgs = [{"role": "user", "content": prompt}]
        head = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        h_ids = self.tok(head, add_special_tokens=False).input_ids
        r_ids = self.tok(r["response"] + self.tok.eos_token, add_special_tokens=False).input_ids
        ids = (h_ids + r_ids)[: self.max_len]
        labels = ([IGNORE] * len(h_ids) + r_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels), feats


def collate(batch, pad_id):
    ids = nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True, padding_value=pad_id)
    labels = nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=IGNORE)
    has_audio = torch.tensor([b[2] is not None for b in batch])
    feats = torch.stack([b[2] for b in batch if b[2] is not None]) if has_audio.any() else None
    return ids, labels, ids.ne(pad_id), feats, has_audio


class Projector(nn.Module):
    def __init__(self, d_in, d_out, k=5):
        super().__init__()
        self.down = nn.Conv1d(d_in, d_in, kernel_size=k, stride=k)
        self.mlp = nn.Sequential(nn.Linear(d_in, d_out), nn.GELU(), nn.Linear(d_out, d_out))

    def forward(self, x):
        return self.mlp(self.down(x.transpose(1, 2)).transpose(1, 2))


class SpeechLLM(nn.Module):
    def __init__(self, args, audio_token_id, vocab_size, dtype):
        super().__init__()
        self.encoder = WhisperModel.from_pretrained(args.whisper, torch_dtype=dtype).encoder
        self.encoder.requires_grad_(False)
        llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=dtype, attn_implementation="sdpa")
        llm.resize_token_embeddings(vocab_size, pad_to_multiple_of=64)
        llm.config.use_cache = False
        llm.gradient_checkpointing_enable()
        llm.enable_input_require_grads()
        self.llm = get_peft_model(llm, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        self.proj = Projector(self.encoder.config.d_model, llm.config.hidden_size).to(dtype)
        self.audio_token_id = audio_token_id

    def forward(self, ids, labels, attn, feats, has_audio):
        emb = self.llm.get_input_embeddings()(ids)
        if feats is not None:
            with torch.no_grad():
                enc = self.encoder(feats.to(emb.dtype)).last_hidden_state
            a = self.proj(enc)  # (Na, T', H)
            rows = []
            ai = 0
            for b in range(ids.shape[0]):
                if not has_audio[b]:
                    rows.append((emb[b], labels[b], attn[b]))
                    continue
                pos = (ids[b] == self.audio_token_id).nonzero()[0, 0]
                e = torch.cat([emb[b, :pos], a[ai], emb[b, pos + 1:]])
                l = torch.cat([labels[b, :pos], labels.new_full((a.shape[1],), IGNORE), labels[b, pos + 1:]])
                m = torch.cat([attn[b, :pos], attn.new_ones(a.shape[1]), attn[b, pos + 1:]])
                rows.append((e, l, m))
                ai += 1
            emb = nn.utils.rnn.pad_sequence([r[0] for r in rows], batch_first=True)
            labels = nn.utils.rnn.pad_sequence([r[1] for r in rows], batch_first=True, padding_value=IGNORE)
            attn = nn.utils.rnn.pad_sequence([r[2] for r in rows], batch_first=True)
        return self.llm(inputs_embeds=emb, attention_mask=attn, labels=labels).loss


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dtype = torch.bfloat16 if args.bf16 else torch.float32

    tok = AutoTokenizer.from_pretrained(args.llm)
    tok.add_special_tokens({"additional_special_tokens": [AUDIO_PLACEHOLDER]})
    audio_id = tok.convert_tokens_to_ids(AUDIO_PLACEHOLDER)
    fe = WhisperFeatureExtractor.from_pretrained(args.whisper)

    model = SpeechLLM(args, audio_id, len(tok), dtype)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    ds = MixDataset(args.train_manifest, tok, fe, args.max_text_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=17)
    dl = DataLoader(ds, batch_size=args.bsz, sampler=sampler, num_workers=6, drop_last=True,
                    collate_fn=lambda b: collate(b, tok.pad_token_id), persistent_workers=True)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = math.ceil(len(dl) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n = sum(p.numel() for p in params)
        print(f"trainable params: {n/1e6:.1f}M, world={world}, opt steps={total_steps}", flush=True)

    step = 0
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        model.train()
        running = 0.0
        for it, (ids, labels, attn, feats, has_audio) in enumerate(dl):
            ids, labels, attn = ids.to(device), labels.to(device), attn.to(device)
            feats = feats.to(device) if feats is not None else None
            sync = (it + 1) % args.accum == 0
            ctx = model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
                    loss = model(ids, labels, attn, feats, has_audio) / args.accum
                loss.backward()
            running += loss.item()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"ep {ep} step {step}/{total_steps} loss {running / 20:.4f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)
                running = 0.0
            if step % args.save_every == 0:
                if rank == 0:
                    d = os.path.join(args.out, f"step{step}")
                    model.module.llm.save_pretrained(d)
                    torch.save(model.module.proj.state_dict(), os.path.join(d, "projector.pt"))
                    tok.save_pretrained(d)
                dist.barrier()

    if rank == 0:
        model.module.llm.save_pretrained(os.path.join(args.out, "final"))
        torch.save(model.module.proj.state_dict(), os.path.join(args.out, "final", "projector.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
