"""3B-parameter ESM-2-architecture protein LM pretrained with DeepSpeed ZeRO-3.

After training we also dump the learned amino-acid input embeddings (for the
substitution-matrix comparison figure) next to the checkpoint.

    deepspeed --num_gpus 8 16_protein_lm_zero3.py --data /shared/uniref50_tok --out /shared/ckpt/esm3b_z3
"""
import argparse
import json
import math
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer

AMINO_ACIDS = list("ACDEFGHIKLMNPQRSTVWY")


class Crops(Dataset):
    def __init__(self, path, max_len):
        arr = np.load(path, mmap_mode="r")
        self.arr, self.max_len = arr, max_len     # (N, max_len) int16, padded with pad id

    def __len__(self):
        return self.arr.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(np.asarray(self.arr[i], dtype=np.int64))


class Masker:
    def __init__(self, tok, p=0.15):
        self.tok, self.p = tok, p
        self.special = torch.tensor(tok.all_special_ids)

    def __call__(self, rows):
        ids = torch.stack(rows)
        labels = ids.clone()
        cand = ~torch.isin(ids, self.special)
        sel = (torch.rand(ids.shape) < self.p) & cand
        labels[~sel] = -100
        u = torch.rand(ids.shape)
        ids[sel & (u < 0.8)] = self.tok.mask_token_id
        rnd = sel & (u >= 0.8) & (u < 0.9)
        ids[rnd] = torch.randint(4, 24, (int(rnd.sum()),))
        return {"input_ids": ids, "attention_mask": (ids != self.tok.pad_token_id).long(), "labels": labels}


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                          "warmup_num_steps": args.warmup,
                                                          "total_num_steps": args.max_steps}},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    acc = torch.zeros(2, device=engine.device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        acc[0] += F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                  reduction="sum").double()
        acc[1] += (batch["labels"] != -100).sum()
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[1]).item()


def export_aa_embeddings(engine, tok, out_dir):
    emb = engine.module.esm.embeddings.word_embeddings.weight.detach().float().cpu()
    ids = tok.convert_tokens_to_ids(AMINO_ACIDS)
    aa = emb[ids]
    aa = F.normalize(aa - aa.mean(0, keepdim=True), dim=-1)
    sim = (aa @ aa.t()).numpy()
    np.save(os.path.join(out_dir, "aa_embeddings.npy"), emb[ids].numpy())
    np.savetxt(os.path.join(out_dir, "aa_cosine.tsv"), sim, delimiter="\t", fmt="%.4f",
               header="\t".join(AMINO_ACIDS))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default="facebook/esm2_t36_3B_UR50D")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--max-steps", type=int, default=200_000)
    ap.add_argument("--eval-every", type=int, default=5000)
    ap.add_argument("--save-every", type=int, default=5000)
    ap.add_argument("--local_rank", type=int, default=-1)   # filled in by the deepspeed launcher
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = EsmTokenizer.from_pretrained(args.tokenizer)
    config = EsmConfig(vocab_size=len(tok), hidden_size=2560, num_hidden_layers=36, num_attention_heads=40,
                       intermediate_size=10240, max_position_embeddings=args.max_len + 2,
                       position_embedding_type="rotary", pad_token_id=tok.pad_token_id,
                       mask_token_id=tok.mask_token_id, token_dropout=True, emb_layer_norm_before=False)
    cfg = ds_config(args)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = EsmForMaskedLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    train_ds = Crops(os.path.join(args.data, "train_crops.npy"), args.max_len)
    valid_full = Crops(os.path.join(args.data, "valid_crops.npy"), args.max_len)
    n_valid = len(valid_full) // (world * args.micro_batch) * world * args.micro_batch
    valid_ds = Subset(valid_full, range(n_valid))
    collate = Masker(tok)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.micro_batch, collate_fn=collate, num_workers=2,
                              sampler=DistributedSampler(valid_ds, shuffle=False))

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    if os.path.exists(os.path.join(args.out, "latest")):
        engine.load_checkpoint(args.out)
    step = engine.global_steps
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ds_config.json"), "w") as fh:
            json.dump(cfg, fh, indent=2)

    epoch = step * args.accum // max(1, len(train_loader))
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if engine.global_steps == step:        # still accumulating
                continue
            step = engine.global_steps
            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {engine.get_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 100:.2f}s/step", flush=True)
                    t0 = time.time()
            if step % args.eval_every == 0:
                vl = evaluate(engine, valid_loader)
                if rank == 0:
                    print(f"step {step} valid ppl {math.exp(vl):.3f}", flush=True)
            if step % args.save_every == 0:
                engine.save_checkpoint(args.out, tag=f"step{step}", client_state={"step": step})
            if step >= args.max_steps:
                break
        epoch += 1

    engine.save_checkpoint(args.out, tag=f"step{step}", client_state={"step": step})
    engine.save_16bit_model(args.out, "pytorch_model.bin")
    if rank == 0:
        export_aa_embeddings(engine, tok, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
