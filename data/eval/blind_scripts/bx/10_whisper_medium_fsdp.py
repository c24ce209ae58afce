"""Whisper-medium full fine-tuning with FSDP (FULL_SHARD, bf16) on in-house call-center data.

Data: jsonl manifests with {"audio": "/path.wav", "text": "..."}.
"""
import argparse
import functools
import json
import os
import time

import librosa
import torch
import torch.distributed as dist
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import WhisperForConditionalGeneration, WhisperProcessor
from transformers.models.whisper.modeling_whisper import WhisperDecoderLayer, WhisperEncoderLayer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="openai/whisper-medium")
    p.add_argument("--train_jsonl", default="data/callcenter/train.jsonl")
    p.add_argument("--valid_jsonl", default="data/callcenter/valid.jsonl")
    p.add_argument("--language", default="english")
    p.add_argument("--out_dir", default="ckpt/whisper-medium-cc")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup_steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class JsonlSpeech(Dataset):
    def __init__(self, path, processor):
        with open(path) as f:
            self.items = [json.loads(l) for l in f if l.strip()]
        self.proc = processor

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ex = self.items[i]
        audio, _ = librosa.load(ex["audio"], sr=16000)
        feats = self.proc.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features[0]
        labels = self.proc.tokenizer(ex["text"]).input_ids
        return feats, torch.tensor(labels)


def collate(batch, sot_id):
    feats, labels = zip(*batch)
    feats = torch.stack(feats)
    L = max(len(l) for l in labels)
    lab = torch.full((len(labels), L), -100, dtype=torch.long)
    for i, l in enumerate(labels):
        lab[i, : len(l)] = l
    if (lab[:, 0] == sot_id).all():
        lab = lab[:, 1:]
    return feats, lab


def lr_at(step, warmup, total, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.0, (total - step) / max(1, total - warmup))


def save_model(model, processor, out_dir, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        os.makedirs(out_dir, exist_ok=True)
        torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
        processor.save_pretrained(out_dir)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tot = torch.zeros(3, device=device)
    for feats, labels in loader:
        feats, labels = feats.to(device), labels.to(device)
        out = model(input_features=feats, labels=labels)
        mask = labels.ne(-100)
        correct = (out.logits.argmax(-1).eq(labels) & mask).sum()
        n = mask.sum()
        tot += torch.stack([out.loss.detach().float() * n, correct.float(), n.float()])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    processor = WhisperProcessor.from_pretrained(args.model, language=args.language, task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.model)
    model.config.use_cache = False
    sot = model.config.decoder_start_token_id

    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={WhisperEncoderLayer, WhisperDecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=mp,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=local_rank,
                 limit_all_gathers=True)

    train_set = JsonlSpeech(args.train_jsonl, processor)
    valid_set = JsonlSpeech(args.valid_jsonl, processor)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # FSDP forward all-gathers parameters, so every rank must run the same number of eval batches
    valid_sampler = DistributedSampler(valid_set, shuffle=False, drop_last=True)
    col = functools.partial(collate, sot_id=sot)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=col, num_workers=args.workers, pin_memory=True)
    valid_loader = DataLoader(valid_set, batch_size=args.batch_size, sampler=valid_sampler,
                              collate_fn=col, num_workers=2)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    step = 0
    best_loss = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for feats, labels in train_loader:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, args.warmup_steps, total, args.lr)
            feats = feats.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = model(input_features=feats, labels=labels).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"({(time.time() - t0) / 20:.2f}s/it)", flush=True)
                t0 = time.time()

        val_loss, val_acc = validate(model, valid_loader, device)
        if rank == 0:
            print(f"== epoch {epoch} valid loss {val_loss:.4f} token acc {val_acc:.4f}", flush=True)
        if val_loss < best_loss:
            best_loss = val_loss
            save_model(model, processor, os.path.join(args.out_dir, "best"), rank)
        dist.barrier()

    save_model(model, processor, os.path.join(args.out_dir, "final"), rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
