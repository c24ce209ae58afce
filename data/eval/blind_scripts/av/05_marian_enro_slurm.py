"""Fine-tune Helsinki-NLP/opus-mt-en-ro on WMT16 En-Ro, token-bucketed batches, multi-node via Slurm.

Submit with:
    #SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=10
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29500
    srun python 05_marian_enro_slurm.py --data /shared/data/wmt16_en_ro --save_dir /shared/ckpt/marian_enro
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
from sacrebleu.metrics import BLEU
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import MarianMTModel, MarianTokenizer, get_inverse_sqrt_schedule


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Helsinki-NLP/opus-mt-en-ro")
    p.add_argument("--data", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--max_tokens", type=int, default=6000)
    p.add_argument("--max_len", type=int, default=200)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max_updates", type=int, default=50000)
    p.add_argument("--validate_every", type=int, default=2000)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


def setup_distributed():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


def read_pairs(data, split):
    with open(os.path.join(data, f"{split}.en")) as f:
        src = [l.strip() for l in f]
    with open(os.path.join(data, f"{split}.ro")) as f:
        tgt = [l.strip() for l in f]
    return src, tgt


def encode(tok, src, tgt, max_len):
    s = tok(src, truncation=True, max_length=max_len)["input_ids"]
    t = tok(text_target=tgt, truncation=True, max_length=max_len)["input_ids"]
    return list(zip(s, t))


def token_batches(examples, max_tokens, seed=None):
    lens = [max(len(s), len(t)) for s, t in examples]
    order = sorted(range(len(examples)), key=lambda i: lens[i])
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, lens[i])
        if cur and w * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, w = [], lens[i]
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    if seed is not None:
        random.Random(seed).shuffle(batches)
    return batches


def shard_batches(batches, rank, world_size):
    # every rank must run the same number of steps: top up with batches from the front
    n = math.ceil(len(batches) / world_size) * world_size
    batches = batches + batches[: n - len(batches)]
    return batches[rank::world_size]


def collate(examples, idx, pad_id, device):
    src = [torch.tensor(examples[i][0]) for i in idx]
    tgt = [torch.tensor(examples[i][1]) for i in idx]
    src = torch.nn.utils.rnn.pad_sequence(src, batch_first=True, padding_value=pad_id)
    labels = torch.nn.utils.rnn.pad_sequence(tgt, batch_first=True, padding_value=-100)
    return src.to(device), src.ne(pad_id).long().to(device), labels.to(device)


@torch.no_grad()
def validate(model, tok, examples, refs, args, device, rank, world_size):
    model.eval()
    loss_sum = torch.zeros(2, device=device)
    hyps, my_refs = [], []
    for idx in token_batches(examples, args.max_tokens)[rank::world_size]:
        src, attn, labels = collate(examples, idx, tok.pad_token_id, device)
        out = model(input_ids=src, attention_mask=attn, labels=labels)
        ntok = labels.ne(-100).sum()
        loss_sum += torch.stack([out.loss * ntok, ntok.float()])
        gen = model.generate(input_ids=src, attention_mask=attn, num_beams=args.beam, max_length=args.max_len)
        hyps.extend(tok.batch_decode(gen, skip_special_tokens=True))
        my_refs.extend(refs[i] for i in idx)
    dist.all_reduce(loss_sum)

    # corpus BLEU over all ranks: sum the sufficient statistics
    local = BLEU().corpus_score(hyps, [my_refs])
    stats = torch.tensor(local.counts + local.totals + [local.sys_len, local.ref_len], dtype=torch.float64)
    dist.all_reduce(stats)
    stats = stats.long().tolist()
    bleu = BLEU.compute_bleu(correct=stats[0:4], total=stats[4:8], sys_len=stats[8], ref_len=stats[9]).score
    model.train()
    return (loss_sum[0] / loss_sum[1]).item(), bleu


def save_checkpoint(path, model, optimizer, scheduler, num_updates, best_bleu):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "num_updates": num_updates,
        "best_bleu": best_bleu,
    }, tmp)
    os.replace(tmp, path)


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = MarianTokenizer.from_pretrained(args.model)
    train = encode(tok, *read_pairs(args.data, "train"), args.max_len)
    dev_src, dev_refs = read_pairs(args.data, "dev")
    dev = encode(tok, dev_src, dev_refs, args.max_len)

    model = MarianMTModel.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = get_inverse_sqrt_schedule(optimizer, num_warmup_steps=args.warmup)
    loss_fct = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=args.label_smoothing)

    ckpt_last = os.path.join(args.save_dir, "checkpoint_last.pt")
    num_updates, best_bleu = 0, 0.0
    if os.path.isfile(ckpt_last):
        state = torch.load(ckpt_last, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        num_updates, best_bleu = state["num_updates"], state["best_bleu"]
        if rank == 0:
            print(f"resumed from {ckpt_last} at update {num_updates}")
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    epoch = 0
    model.train()
    t0 = time.time()
    while num_updates < args.max_updates:
        epoch += 1
        my_batches = shard_batches(token_batches(train, args.max_tokens, seed=args.seed + epoch), rank, world_size)
        for idx in my_batches:
            src, attn, labels = collate(train, idx, tok.pad_token_id, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=src, attention_mask=attn, labels=labels).logits
            loss = loss_fct(logits.float().view(-1, logits.size(-1)), labels.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            num_updates += 1

            if num_updates % 100 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} upd {num_updates} loss {avg.item():.3f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

            if num_updates % args.validate_every == 0:
                dev_loss, bleu = validate(model.module, tok, dev, dev_refs, args, device, rank, world_size)
                if rank == 0:
                    print(f"| valid upd {num_updates} loss {dev_loss:.3f} BLEU {bleu:.2f}", flush=True)
                    if bleu > best_bleu:
                        best_bleu = bleu
                        model.module.save_pretrained(os.path.join(args.save_dir, "best"))
                        tok.save_pretrained(os.path.join(args.save_dir, "best"))
                    save_checkpoint(ckpt_last, model, optimizer, scheduler, num_updates, best_bleu)
                dist.barrier()
            if num_updates >= args.max_updates:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
