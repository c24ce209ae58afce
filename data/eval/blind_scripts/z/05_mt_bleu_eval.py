"""
Fine-tune a MarianMT model (zh->en) with DDP and run beam-search BLEU on the dev set
every --eval-steps steps. Best checkpoint (by sacreBLEU) is kept.

    torchrun --nnodes=1 --nproc_per_node=8 05_mt_bleu_eval.py \
        --train data/train.zh-en.tsv --dev data/dev.zh-en.tsv --out runs/marian_zh_en
"""
import argparse
import csv
import logging
import os
import time

import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import MarianMTModel, MarianTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Helsinki-NLP/opus-mt-zh-en")
    parser.add_argument("--train", required=True)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--out", default="runs/marian")
    parser.add_argument("--max-src-len", type=int, default=128)
    parser.add_argument("--max-tgt-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=1000)
    parser.add_argument("--eval-steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=17)
    return parser.parse_args()


class ParallelCorpus(Dataset):
    def __init__(self, path):
        self.pairs = []
        with open(path, encoding="utf-8") as f:
            for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
                if len(row) >= 2 and row[0].strip() and row[1].strip():
                    self.pairs.append((row[0].strip(), row[1].strip()))

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        src, tgt = self.pairs[i]
        return {"idx": i, "src": src, "tgt": tgt}


class Seq2SeqCollator:
    def __init__(self, tok, max_src, max_tgt):
        self.tok, self.max_src, self.max_tgt = tok, max_src, max_tgt

    def __call__(self, batch):
        enc = self.tok([b["src"] for b in batch], text_target=[b["tgt"] for b in batch],
                       max_length=self.max_src, truncation=True, padding=True, return_tensors="pt")
        enc["labels"][enc["labels"] == self.tok.pad_token_id] = -100
        enc["idx"] = torch.tensor([b["idx"] for b in batch], dtype=torch.long)
        return enc


@torch.no_grad()
def evaluate_bleu(model, tok, loader, dev_set, device, args, rank, world_size):
    model.eval()
    hyps_by_idx = {}
    for batch in loader:
        idx = batch["idx"].to(device)
        gen = model.generate(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            num_beams=args.num_beams,
            max_new_tokens=args.max_tgt_len,
        )
        # collect every rank's hypotheses on all ranks
        idx_list = [torch.zeros_like(idx) for _ in range(world_size)]
        gen_list = [torch.zeros_like(gen) for _ in range(world_size)]
        dist.all_gather(idx_list, idx)
        dist.all_gather(gen_list, gen)
        if rank == 0:
            for g_idx, g_gen in zip(idx_list, gen_list):
                texts = tok.batch_decode(g_gen, skip_special_tokens=True)
                for i, t in zip(g_idx.tolist(), texts):
                    hyps_by_idx.setdefault(i, t)  # DistributedSampler pads with repeats
    model.train()
    if rank != 0:
        return None
    order = sorted(hyps_by_idx)
    hyps = [hyps_by_idx[i] for i in order]
    refs = [dev_set.pairs[i][1] for i in order]
    return sacrebleu.corpus_bleu(hyps, [refs]).score


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    torch.manual_seed(args.seed)

    tok = MarianTokenizer.from_pretrained(args.model)
    model = MarianMTModel.from_pretrained(args.model).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])

    train_set, dev_set = ParallelCorpus(args.train), ParallelCorpus(args.dev)
    collate = Seq2SeqCollator(tok, args.max_src_len, args.max_tgt_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(dev_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=args.eval_batch_size, sampler=dev_sampler,
                            collate_fn=collate, num_workers=4, pin_memory=True)

    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total)
    scaler = torch.cuda.amp.GradScaler()

    logger.info("train=%d dev=%d, %d steps/epoch, world_size=%d",
                len(train_set), len(dev_set), len(train_loader), world_size)

    best_bleu, step = -1.0, 0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        tic = time.time()
        for batch in train_loader:
            batch.pop("idx")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ddp_model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1

            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f (%.2f s/100 it)", epoch, step, loss.item(), time.time() - tic)
                tic = time.time()

            if step % args.eval_steps == 0:
                bleu = evaluate_bleu(model, tok, dev_loader, dev_set, device, args, rank, world_size)
                if rank == 0:
                    logger.info("step %d dev BLEU %.2f (best %.2f)", step, bleu, best_bleu)
                    if bleu > best_bleu:
                        best_bleu = bleu
                        model.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        model.save_pretrained(os.path.join(args.out, "last"))
        tok.save_pretrained(os.path.join(args.out, "last"))
        logger.info("done, best dev BLEU %.2f", best_bleu)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
