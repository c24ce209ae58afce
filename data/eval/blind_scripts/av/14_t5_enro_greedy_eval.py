"""t5-base fine-tuning on WMT16 En->Ro with greedy-decoded BLEU/chrF on the full dev set.

torchrun --nproc_per_node=8 14_t5_enro_greedy_eval.py --out runs/t5_enro
"""
import argparse
import os
import time

import sacrebleu
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, T5ForConditionalGeneration
from transformers.optimization import Adafactor, get_constant_schedule_with_warmup

PREFIX = "translate English to Romanian: "


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="t5-base")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=128)
    ap.add_argument("--gen_len", type=int, default=128)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--eval_bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--eval_every", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def pad_right(seqs, pad_id):
    longest = max(s.size(1) for s in seqs)
    return torch.cat([F.pad(s, (0, longest - s.size(1)), value=pad_id) for s in seqs], dim=0)


@torch.no_grad()
def greedy_eval(model, loader, tokenizer, refs, device, world, max_new_tokens=128):
    model.eval()
    chunks = []
    for batch in loader:
        out = model.generate(input_ids=batch["input_ids"].to(device),
                             attention_mask=batch["attention_mask"].to(device),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
        chunks.append(out)
    preds = pad_right(chunks, tokenizer.pad_token_id)

    gathered = [torch.zeros_like(preds) for _ in range(world)]
    dist.all_gather(gathered, preds)
    model.train()
    if dist.get_rank() != 0:
        return None
    # DistributedSampler(shuffle=False) hands rank r the indices r, r+world, ...; undo the interleave
    stacked = torch.stack(gathered, dim=1).flatten(0, 1)[: len(refs)]
    hyps = tokenizer.batch_decode(stacked, skip_special_tokens=True)
    return {
        "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
        "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
        "example": hyps[0],
    }


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = T5ForConditionalGeneration.from_pretrained(args.model)

    def preprocess(ex):
        src = [PREFIX + x["en"] for x in ex["translation"]]
        tgt = [x["ro"] for x in ex["translation"]]
        return tokenizer(src, text_target=tgt, max_length=args.max_len, truncation=True)

    with_cache_first = rank == 0
    if not with_cache_first:
        dist.barrier()
    raw = load_dataset("wmt16", "ro-en")
    data = raw.map(preprocess, batched=True, remove_columns=["translation"], num_proc=8)
    if with_cache_first:
        dist.barrier()
    dev_refs = [x["ro"] for x in raw["validation"]["translation"]]

    collator = DataCollatorForSeq2Seq(tokenizer, model=model, padding="longest")
    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(data["validation"], shuffle=False)
    train_loader = DataLoader(data["train"], batch_size=args.bs, sampler=train_sampler, collate_fn=collator,
                              num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(data["validation"], batch_size=args.eval_bs, sampler=dev_sampler, collate_fn=collator)

    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = Adafactor(ddp_model.parameters(), lr=args.lr, scale_parameter=False, relative_step=False,
                          warmup_init=False)
    scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(data['train'])} | dev {len(dev_refs)} | {len(train_loader)} steps/epoch/rank")

    step, best = 0, -1.0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp_model(**batch).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {(l / world).item():.4f} {time.time() - t0:.0f}s", flush=True)

            if step % args.eval_every == 0:
                res = greedy_eval(model, dev_loader, tokenizer, dev_refs, device, world, args.gen_len)
                if rank == 0:
                    print(f"step {step}: dev BLEU {res['bleu']:.2f} chrF {res['chrf']:.2f} | {res['example']}",
                          flush=True)
                    if res["bleu"] > best:
                        best = res["bleu"]
                        model.save_pretrained(os.path.join(args.out, "best"))
                        tokenizer.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
