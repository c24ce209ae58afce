"""Fine-tune NLLB-200 (1.3B) on in-house parallel data with DeepSpeed ZeRO-3.

deepspeed --num_gpus 8 07_nllb_zero3_finetune.py \
    --train data/legal/train.tsv --dev data/legal/dev.tsv \
    --src-lang eng_Latn --tgt-lang deu_Latn --export exports/nllb-legal-en-de
"""
import argparse
import csv
import os

import deepspeed
import sacrebleu
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="facebook/nllb-200-1.3B")
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--src-lang", default="eng_Latn")
    p.add_argument("--tgt-lang", default="deu_Latn")
    p.add_argument("--micro-bsz", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--ckpt-dir", default="ckpt/nllb-legal")
    p.add_argument("--export", required=True)
    p.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return p.parse_args()


class TsvPairs(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path, encoding="utf-8", newline="") as f:
            self.rows = [(r[0], r[1]) for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
                         if len(r) >= 2]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        src, tgt = self.rows[i]
        enc = self.tok(src, text_target=tgt, max_length=self.max_len, truncation=True)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": enc["labels"]}


class IndexedSources(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return i, self.rows[i][0]


def ds_config(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bsz,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bsz * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98],
                                                   "eps": 1e-8, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                      "warmup_num_steps": args.warmup}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }


@torch.no_grad()
def evaluate(engine, tok, dev_rows, args, rank, world):
    engine.eval()
    ds = IndexedSources(dev_rows)
    # padded sampler: every rank runs the same number of generate() calls, which ZeRO-3 needs
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    forced = tok.convert_tokens_to_ids(args.tgt_lang)
    out = []
    for idx, srcs in loader:
        enc = tok(list(srcs), return_tensors="pt", padding=True, truncation=True,
                  max_length=args.max_len).to(engine.device)
        gen = engine.module.generate(**enc, forced_bos_token_id=forced, num_beams=4,
                                     max_new_tokens=args.max_len, synced_gpus=True)
        out.extend(zip(idx.tolist(), tok.batch_decode(gen, skip_special_tokens=True)))
    parts = [None] * world
    dist.all_gather_object(parts, out)
    engine.train()
    hyp = {}
    for part in parts:
        hyp.update(part)
    hyps = [hyp[i] for i in range(len(dev_rows))]
    refs = [t for _, t in dev_rows]
    return sacrebleu.corpus_bleu(hyps, [refs]).score, sacrebleu.corpus_chrf(hyps, [refs]).score


def main():
    args = get_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model, src_lang=args.src_lang, tgt_lang=args.tgt_lang)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.config.use_cache = True

    train = TsvPairs(args.train, tok, args.max_len)
    dev = TsvPairs(args.dev, tok, args.max_len)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    collator = DataCollatorForSeq2Seq(tok, model=model, pad_to_multiple_of=8)
    loader = DataLoader(train, batch_size=args.micro_bsz, sampler=sampler, collate_fn=collator,
                        num_workers=4, drop_last=True)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args, world))

    best = -1.0
    micro = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            micro += 1

            if micro % args.grad_accum == 0:
                upd = engine.global_steps
                if upd % 50 == 0:
                    l = loss.detach().float().clone()
                    dist.all_reduce(l)
                    if rank == 0:
                        print(f"epoch {epoch} update {upd} loss {l.item() / world:.4f}", flush=True)
                if upd > 0 and upd % args.eval_every == 0:
                    bleu, chrf = evaluate(engine, tok, dev.rows, args, rank, world)
                    if rank == 0:
                        print(f"update {upd}: dev BLEU {bleu:.2f} chrF {chrf:.2f}", flush=True)
                    if bleu > best:
                        best = bleu
                        engine.save_checkpoint(args.ckpt_dir, tag="best", client_state={"bleu": bleu})

    bleu, chrf = evaluate(engine, tok, dev.rows, args, rank, world)
    if rank == 0:
        print(f"final dev BLEU {bleu:.2f} chrF {chrf:.2f}", flush=True)
    engine.save_checkpoint(args.ckpt_dir, tag="last", client_state={"bleu": bleu})

    if rank == 0:
        os.makedirs(args.export, exist_ok=True)
        engine.module.save_pretrained(args.export, state_dict=engine.module.state_dict())
        tok.save_pretrained(args.export)
        print(f"exported HF model to {args.export}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
