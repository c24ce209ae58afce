"""CUAD as extractive QA (one question per clause category) with BigBird-large
under DeepSpeed ZeRO-3. Features (4096-token windows, start/end positions,
0/0 for "no clause in this window") are produced by prepare_cuad_features.py.

    deepspeed --num_gpus 8 17_zero3_bigbird_cuad_qa.py --features_dir /data/cuad/feats_bigbird4096 \
        --out_dir /data/runs/cuad_bigbird_z3
"""
import argparse
import logging
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering

logger = logging.getLogger("cuad_z3")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--features_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--model", default="google/bigbird-roberta-large")
    ap.add_argument("--micro_batch", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup_frac", type=float, default=0.1)
    ap.add_argument("--max_answer_len", type=int, default=512)
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return ap.parse_args()


def load_split(features_dir, split):
    f = torch.load(os.path.join(features_dir, f"{split}.pt"), map_location="cpu")
    return TensorDataset(f["input_ids"], f["attention_mask"], f["start_positions"], f["end_positions"])


def best_span(start_logits, end_logits, attention_mask, max_len):
    """Best (start, end) with start <= end < start + max_len; (0, 0) means no answer."""
    s = start_logits.masked_fill(attention_mask == 0, -1e4)
    e = end_logits.masked_fill(attention_mask == 0, -1e4)
    scores = s.unsqueeze(2) + e.unsqueeze(1)  # B x L x L
    L = s.size(1)
    band = torch.ones(L, L, dtype=torch.bool, device=s.device).triu().tril(max_len - 1)
    scores = scores.masked_fill(~band, -1e9)
    flat = scores.view(scores.size(0), -1).argmax(-1)
    return flat // L, flat % L


@torch.no_grad()
def evaluate(engine, loader, max_answer_len, rank, world):
    engine.eval()
    device = engine.device
    n = len(loader.dataset)
    # exact match, token-F1 sum, count (padded duplicates of DistributedSampler excluded)
    stats = torch.zeros(3, device=device)
    seen = 0
    for ids, att, sp, ep in loader:
        ids, att, sp, ep = ids.to(device), att.to(device), sp.to(device), ep.to(device)
        out = engine(input_ids=ids, attention_mask=att)
        ps, pe = best_span(out.start_logits.float(), out.end_logits.float(), att, max_answer_len)
        pos = rank + world * torch.arange(seen, seen + ids.size(0), device=device)
        keep = (pos < n).float()
        seen += ids.size(0)
        em = ((ps == sp) & (pe == ep)).float()
        inter = (torch.minimum(pe, ep) - torch.maximum(ps, sp) + 1).clamp(min=0).float()
        p_len, g_len = (pe - ps + 1).float(), (ep - sp + 1).float()
        f1 = torch.where(inter > 0, 2 * inter / (p_len + g_len), em)
        stats += torch.stack([(em * keep).sum(), (f1 * keep).sum(), keep.sum()])
    dist.all_reduce(stats)
    engine.train()
    return {"exact": (stats[0] / stats[2]).item(), "f1": (stats[1] / stats[2]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    train_ds = load_split(args.features_dir, "train")
    dev_ds = load_split(args.features_dir, "dev")
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, num_workers=2,
                          pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=args.micro_batch * 2, sampler=dev_sampler, num_workers=2)

    updates = math.ceil(len(train_dl) / args.grad_accum) * args.epochs
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": int(args.warmup_frac * updates),
                                 "total_num_steps": updates}},
        "steps_per_print": 200,
        "wall_clock_breakdown": False,
    }

    model = AutoModelForQuestionAnswering.from_pretrained(args.model, attention_type="block_sparse")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    os.makedirs(args.out_dir, exist_ok=True)
    best_f1 = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        for step, (ids, att, sp, ep) in enumerate(train_dl):
            ids, att = ids.to(engine.device), att.to(engine.device)
            sp, ep = sp.to(engine.device), ep.to(engine.device)
            out = engine(input_ids=ids, attention_mask=att, start_positions=sp, end_positions=ep)
            engine.backward(out.loss)
            engine.step()
            if step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f %.0fs", epoch, step, len(train_dl),
                            out.loss.item(), time.time() - t0)

        metrics = evaluate(engine, dev_dl, args.max_answer_len, rank, world)
        logger.info("epoch %d dev %s", epoch, metrics)
        engine.save_checkpoint(os.path.join(args.out_dir, "ds_ckpt"), tag=f"epoch{epoch}",
                               client_state={"epoch": epoch, "dev": metrics})
        if metrics["f1"] > best_f1:
            best_f1 = metrics["f1"]
            if rank == 0:
                # plain state dict for the inference service (loads into AutoModelForQuestionAnswering)
                torch.save(engine.module.state_dict(), os.path.join(args.out_dir, "best_model.bin"))
                engine.module.config.save_pretrained(args.out_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
