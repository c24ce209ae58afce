"""ESM-2 150M-architecture MLM on a viral + phage protein set, FSDP (FULL_SHARD), bf16,
activation checkpointing.  Checkpoints are full (unsharded) state dicts so they can be
resumed on a different number of GPUs and loaded by the downstream HF pipelines.

    torchrun --nnodes=$NNODES --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        17_fsdp_protein_lm_resume.py --data /lab/shared/viral_prot --out /lab/shared/runs/vesm150
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer
from transformers.models.esm.modeling_esm import EsmLayer


class PaddedCrops(Dataset):
    def __init__(self, path):
        self.x = np.load(path, mmap_mode="r")      # (N, 514) int16, <cls> ... <eos> <pad>*

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i].astype(np.int64))


def make_collate(tok, p=0.15):
    special = torch.tensor(tok.all_special_ids)

    def collate(rows):
        ids = torch.stack(rows)
        sel = (torch.rand(ids.shape) < p) & ~torch.isin(ids, special)
        labels = ids.masked_fill(~sel, -100)
        u = torch.rand(ids.shape)
        ids = ids.masked_fill(sel & (u < 0.8), tok.mask_token_id)
        rnd = sel & (u >= 0.8) & (u < 0.9)
        ids[rnd] = torch.randint(4, 24, (int(rnd.sum()),))
        return ids, (ids != tok.pad_token_id).long(), labels
    return collate


def lr_at(samples_seen, total_samples, warmup_samples, peak):
    if samples_seen < warmup_samples:
        return peak * samples_seen / warmup_samples
    frac = (samples_seen - warmup_samples) / max(1, total_samples - warmup_samples)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


SAVE_CFG = (FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))
LOAD_CFG = (FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
            FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False))


def save_full(model, opt, meta, path):
    # every rank takes part in gathering the shards; only rank 0 receives and writes them
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *SAVE_CFG):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd, **meta}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for ids, attn, labels in loader:
        ids, attn, labels = ids.to(device), attn.to(device), labels.to(device)
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
        acc[0] += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        acc[1] += (labels != -100).sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default="facebook/esm2_t30_150M_UR50D")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup-samples", type=int, default=500_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = EsmTokenizer.from_pretrained(args.tokenizer)
    config = EsmConfig(vocab_size=len(tok), hidden_size=640, num_hidden_layers=30, num_attention_heads=20,
                       intermediate_size=2560, max_position_embeddings=1026, position_embedding_type="rotary",
                       pad_token_id=tok.pad_token_id, mask_token_id=tok.mask_token_id, token_dropout=True,
                       emb_layer_norm_before=False)
    model = EsmForMaskedLM(config)

    ckpt_path = os.path.join(args.out, "last_full.pt")
    ck = None
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])         # unsharded weights into the unwrapped model

    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={EsmLayer}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=local_rank,
                 sync_module_states=True, use_orig_params=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, EsmLayer))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)

    start_epoch, samples_seen = 0, 0
    if ck is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *LOAD_CFG):
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ck["optim"]))
        start_epoch, samples_seen = ck["epoch"] + 1, ck["samples_seen"]
        del ck

    collate = make_collate(tok)
    train_ds = PaddedCrops(os.path.join(args.data, "train.npy"))
    valid_full = PaddedCrops(os.path.join(args.data, "valid.npy"))
    per_round = world * args.batch_size
    valid_ds = Subset(valid_full, range(len(valid_full) // per_round * per_round))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size, collate_fn=collate, num_workers=2,
                              sampler=DistributedSampler(valid_ds, shuffle=False))
    total_samples = args.epochs * len(train_ds)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}: {len(loader)} steps/epoch, resuming at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (ids, attn, labels) in enumerate(loader):
            for g in opt.param_groups:
                g["lr"] = lr_at(samples_seen, total_samples, args.warmup_samples, args.lr)
            out = model(input_ids=ids.to(device, non_blocking=True), attention_mask=attn.to(device, non_blocking=True),
                        labels=labels.to(device, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            samples_seen += per_round
            if it % 200 == 0:
                l = out.loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(loader)} loss {l.item():.4f} "
                          f"lr {opt.param_groups[0]['lr']:.2e}", flush=True)

        vl = evaluate(model, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} valid ppl {math.exp(vl):.3f} ({(time.time() - t0) / 60:.1f} min)", flush=True)
        save_full(model, opt, {"epoch": epoch, "samples_seen": samples_seen, "world_size": world}, ckpt_path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
