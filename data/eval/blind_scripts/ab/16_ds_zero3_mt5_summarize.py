# -*- coding: utf-8 -*-
"""
mT5-XL 中文摘要微调, DeepSpeed ZeRO-3 (bf16).

deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 16_ds_zero3_mt5_summarize.py \
    --train /fsx/lcsts/train.jsonl --valid /fsx/lcsts/valid.jsonl --out /fsx/runs/mt5xl_lcsts
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="google/mt5-xl")
    p.add_argument("--src-len", type=int, default=512)
    p.add_argument("--tgt-len", type=int, default=64)
    p.add_argument("--micro-bsz", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=-1)  # deepspeed launcher 会传这个参数
    return p.parse_args()


class SummData(Dataset):
    def __init__(self, path, tok, src_len, tgt_len):
        with open(path, encoding="utf-8") as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.src_len, self.tgt_len = tok, src_len, tgt_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        src = self.tok("摘要: " + r["content"], max_length=self.src_len, truncation=True,
                       padding="max_length", return_tensors="pt")
        tgt = self.tok(r["summary"], max_length=self.tgt_len, truncation=True,
                       padding="max_length", return_tensors="pt")["input_ids"][0]
        tgt[tgt == self.tok.pad_token_id] = -100
        return i, src["input_ids"][0], src["attention_mask"][0], tgt


def rouge_l_char(pred, ref):
    # 中文按字计算 ROUGE-L
    a, b = list(pred), list(ref)
    if not a or not b:
        return 0.0
    dp = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            cur = dp[j]
            dp[j] = prev + 1 if x == y else max(dp[j], dp[j - 1])
            prev = cur
    lcs = dp[-1]
    p, r = lcs / len(a), lcs / len(b)
    return 0.0 if lcs == 0 else 2 * p * r / (p + r)


@torch.no_grad()
def evaluate(engine, loader, tok, valid_ds):
    engine.eval()
    local = []
    for idx, ids, att, labels in loader:
        ids, att, labels = ids.to(engine.device), att.to(engine.device), labels.to(engine.device)
        logits = engine(input_ids=ids, attention_mask=att, labels=labels).logits
        tok_loss = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none").sum(1)
        ntok = (labels != -100).sum(1)
        # ZeRO-3 下各 rank 生成长度不同, 必须 synced_gpus=True, 否则会卡在 all-gather
        gen = engine.module.generate(input_ids=ids, attention_mask=att, max_new_tokens=64,
                                     num_beams=4, synced_gpus=True)
        preds = tok.batch_decode(gen, skip_special_tokens=True)
        for k in range(len(idx)):
            local.append((int(idx[k]), tok_loss[k].item(), int(ntok[k]), preds[k]))
    # DistributedSampler 会补齐样本, 按 idx 去重后再算指标
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    seen = {}
    for part in gathered:
        for i, l, n, p in part:
            seen[i] = (l, n, p)
    loss = sum(v[0] for v in seen.values()) / max(1, sum(v[1] for v in seen.values()))
    rouge = sum(rouge_l_char(v[2], valid_ds.rows[i]["summary"]) for i, v in seen.items()) / len(seen)
    engine.train()
    return loss, rouge


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    ds_cfg = {
        "train_micro_batch_size_per_gpu": args.micro_bsz,
        "gradient_accumulation_steps": args.grad_accum,
        # 全局 batch 按实际 world size 计算, 换机器数量不用改配置
        "train_batch_size": args.micro_bsz * args.grad_accum * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
    }
    # 必须在 from_pretrained 之前创建并保持引用, 这样模型会直接以分片方式加载
    dschf = HfDeepSpeedConfig(ds_cfg)  # noqa: F841
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)

    train_ds = SummData(args.train, tok, args.src_len, args.tgt_len)
    valid_ds = SummData(args.valid, tok, args.src_len, args.tgt_len)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=11)
    val_sampler = DistributedSampler(valid_ds, num_replicas=world, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=sampler, num_workers=4, drop_last=True)
    val_dl = DataLoader(valid_ds, batch_size=args.micro_bsz, sampler=val_sampler, num_workers=2)

    ckpt_dir = os.path.join(args.out, "ds_ckpt")
    start_epoch, best, bad = 0, float("inf"), 0
    if os.path.exists(os.path.join(ckpt_dir, "latest")):
        # 所有 rank 都要调用 load_checkpoint, 每个 rank 读自己的分片
        _, client = engine.load_checkpoint(ckpt_dir)
        start_epoch, best, bad = client["epoch"], client["best"], client["bad"]
        if rank == 0:
            print(f"从 {ckpt_dir} 恢复: epoch={start_epoch} best={best:.4f}", flush=True)

    stop = False
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (_, ids, att, labels) in enumerate(train_dl):
            ids, att, labels = ids.to(engine.device), att.to(engine.device), labels.to(engine.device)
            loss = engine(input_ids=ids, attention_mask=att, labels=labels).loss
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)

            if engine.is_gradient_accumulation_boundary() and engine.global_steps % args.eval_every == 0:
                val_loss, rouge = evaluate(engine, val_dl, tok, valid_ds)
                # val_loss 在每个 rank 上都是同一个值 (all_gather 后去重), 早停判断自然一致
                if val_loss < best:
                    best, bad = val_loss, 0
                    # 所有 rank 一起调用: ZeRO-3 需要先把分片的参数 gather 起来
                    engine.save_16bit_model(os.path.join(args.out, "best_hf"), "pytorch_model.bin")
                    if rank == 0:
                        engine.module.config.save_pretrained(os.path.join(args.out, "best_hf"))
                        tok.save_pretrained(os.path.join(args.out, "best_hf"))
                else:
                    bad += 1
                if rank == 0:
                    print(f"[eval] step {engine.global_steps} val_loss {val_loss:.4f} "
                          f"rougeL {rouge:.4f} best {best:.4f} bad {bad}", flush=True)
                engine.save_checkpoint(ckpt_dir, client_state={"epoch": epoch, "best": best, "bad": bad})
                if bad >= args.patience:
                    stop = True
                    break
        if stop:
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
