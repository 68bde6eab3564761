import struct, sys
def write(path, n, vocab, seed):
    x = seed
    toks = []
    prev = 0
    for i in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        t = (x >> 33) % vocab if i % 7 == 0 else (prev * 3 + 1) % vocab
        toks.append(t); prev = t
    hdr = [20240520, 1, n] + [0] * 253
    with open(path, 'wb') as f:
        f.write(struct.pack('<256i', *hdr)); f.write(struct.pack('<%dH' % n, *toks))
write(sys.argv[1] + '/train.bin', 20000, 64, 1)
write(sys.argv[1] + '/val.bin', 4000, 64, 2)
