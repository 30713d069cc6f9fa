#!/usr/bin/perl
# translate.pl IN.cu OUT.cc: a CUDA source as C++ for the CUDA emulator
# (tests/cuda_emu/cuda_emu_kernel.hpp): kernel<<<grid, block, smem, stream>>>(args)
# becomes fl_emu::launcher("kernel", kernel, grid, block, smem, stream)(args), and
# __shared__ declarations per-block arrays. Lines keep their numbers.
use strict;
use warnings;

my ($in, $out) = @ARGV;
die "usage: translate.pl IN.cu OUT.cc\n" unless defined $out;
open(my $f, '<', $in) or die "translate.pl: cannot read $in: $!\n";
my $s = do { local $/; <$f> };
close $f;

$s =~ s/\b([A-Za-z_]\w*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\(/fl_emu::launcher("$1", $1, $2)(/gs;
# the dynamic array, optionally aligned (its base is 256-byte aligned):
# extern __shared__ __align__(128) unsigned char smem[];
$s =~ s/extern\s+__shared__\s+(?:__align__\s*\(\s*\w+\s*\)\s+)?((?:unsigned\s+)?\w+)\s+(\w+)\s*\[\s*\]\s*;/$1 *$2 = ($1 *)fl_emu::dynamic_shared();/g;
# static arrays, likewise (each 256-byte aligned)
$s =~ s{__shared__\s+(?:__align__\s*\(\s*\w+\s*\)\s+)?((?:unsigned\s+)?\w+)\s+([^;]+);}{
    my ($type, $decls) = ($1, $2);
    my @out;
    for my $d (split /,(?![^\[]*\])/, $decls) {
        $d =~ /^\s*(\w+)\s*((?:\[[^\]]+\]\s*)+)$/ or die "translate.pl: $in: cannot read the __shared__ declaration '$d'\n";
        my ($name, $dims) = ($1, $2);
        $dims =~ s/\s+$//;
        push @out, "FL_EMU_SHARED($type, $name, $dims)";
    }
    join('; ', @out) . ';';
}ge;
die "translate.pl: $in: a launch left untranslated\n" if $s =~ /<<</;

open(my $o, '>', "$out.tmp") or die "translate.pl: cannot write $out: $!\n";
print $o "#line 1 \"$in\"\n$s";
close $o or die "translate.pl: cannot write $out: $!\n";
rename("$out.tmp", $out) or die "translate.pl: cannot write $out: $!\n";
