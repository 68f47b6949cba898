//! `$(VAR)` references, as the kubelet's forked Go expansion
//! (`third_party/forked/golang/expansion`: `Expand`, `MappingFuncFor`).
//! `$(NAME)` is replaced by the first context holding `NAME`; an undefined
//! name stays as written; `$$` is an escaped `$`; a `$` followed by anything
//! else, an unterminated `$(` and shell syntax (`${X}`, `$X`) pass through.
//! Difference: after a `$`, Go copies the next byte as a rune, which mangles
//! a non-ASCII character there; here the input's bytes are kept.

use std::collections::BTreeMap;

/// Expands the `$(VAR)` references of `input` with `mapping` (the kubelet's
/// `expansion.Expand`).
pub fn expand(input: &str, mapping: &dyn Fn(&str) -> String) -> String {
    let bytes = input.as_bytes();
    let mut out = String::with_capacity(input.len());
    // Everything before `checkpoint` is in `out`; `$`, `(` and `)` are ASCII,
    // so both ends of a copied slice are character boundaries.
    let mut checkpoint = 0;
    let mut cursor = 0;
    while cursor < bytes.len() {
        if bytes[cursor] == b'$' && cursor + 1 < bytes.len() {
            out.push_str(&input[checkpoint..cursor]);
            let rest = &input[cursor + 1..];
            match rest.as_bytes()[0] {
                // An escaped operator: one `$`.
                b'$' => {
                    out.push('$');
                    cursor += 1;
                }
                b'(' => match rest.find(')') {
                    Some(close) => {
                        out.push_str(&mapping(&rest[1..close]));
                        cursor += close + 1;
                    }
                    // Incomplete: `$(` is kept and the scan goes on after it.
                    None => {
                        out.push_str("$(");
                        cursor += 1;
                    }
                },
                // Not an expression: the operator stays; the byte after it
                // (never a `$` or `(`) is copied with what follows.
                _ => {
                    out.push('$');
                }
            }
            checkpoint = cursor + 1;
        }
        cursor += 1;
    }
    out.push_str(&input[checkpoint.min(input.len())..]);
    out
}

/// The kubelet's `MappingFuncFor`: the first context holding a name gives its
/// value; an undefined name is written back as `$(name)`.
pub fn mapping_for<'a>(
    contexts: &'a [&'a BTreeMap<String, String>],
) -> impl Fn(&str) -> String + 'a {
    move |name: &str| {
        contexts
            .iter()
            .find_map(|c| c.get(name).cloned())
            .unwrap_or_else(|| format!("$({name})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// The kubelet's `doExpansionTest` table (`expand_test.go`), with one
    /// context and with the variables split over two.
    #[test]
    fn the_kubelet_s_expansion_table() {
        let one = context(&[
            ("VAR_A", "A"),
            ("VAR_B", "B"),
            ("VAR_C", "C"),
            ("VAR_REF", "$(VAR_A)"),
            ("VAR_EMPTY", ""),
        ]);
        let first = context(&[("VAR_A", "A"), ("VAR_EMPTY", "")]);
        let second = context(&[("VAR_B", "B"), ("VAR_C", "C"), ("VAR_REF", "$(VAR_A)")]);
        let cases = [
            ("whole string", "$(VAR_A)", "A"),
            ("repeat", "$(VAR_A)-$(VAR_A)", "A-A"),
            ("beginning", "$(VAR_A)-1", "A-1"),
            ("middle", "___$(VAR_B)___", "___B___"),
            ("end", "___$(VAR_C)", "___C"),
            ("compound", "$(VAR_A)_$(VAR_B)_$(VAR_C)", "A_B_C"),
            ("escape & expand", "$$(VAR_B)_$(VAR_A)", "$(VAR_B)_A"),
            (
                "compound escape",
                "$$(VAR_A)_$$(VAR_B)",
                "$(VAR_A)_$(VAR_B)",
            ),
            ("mixed in escapes", "f000-$$VAR_A", "f000-$VAR_A"),
            ("backslash escape ignored", "foo\\$(VAR_C)bar", "foo\\Cbar"),
            (
                "backslash escape ignored 2",
                "foo\\\\$(VAR_C)bar",
                "foo\\\\Cbar",
            ),
            (
                "lots of backslashes",
                "foo\\\\\\\\$(VAR_A)bar",
                "foo\\\\\\\\Abar",
            ),
            (
                "nested var references",
                "$(VAR_A$(VAR_B))",
                "$(VAR_A$(VAR_B))",
            ),
            (
                "nested var references second type",
                "$(VAR_A$(VAR_B)",
                "$(VAR_A$(VAR_B)",
            ),
            ("value is a reference", "$(VAR_REF)", "$(VAR_A)"),
            (
                "value is a reference x 2",
                "%%$(VAR_REF)--$(VAR_REF)%%",
                "%%$(VAR_A)--$(VAR_A)%%",
            ),
            ("empty var", "foo$(VAR_EMPTY)bar", "foobar"),
            (
                "unterminated expression",
                "foo$(VAR_Awhoops!",
                "foo$(VAR_Awhoops!",
            ),
            (
                "expression without operator",
                "f00__(VAR_A)__",
                "f00__(VAR_A)__",
            ),
            ("shell special vars pass through", "$?_boo_$!", "$?_boo_$!"),
            ("bare operators are ignored", "$VAR_A", "$VAR_A"),
            (
                "undefined vars are passed through",
                "$(VAR_DNE)",
                "$(VAR_DNE)",
            ),
            (
                "multiple (even) operators, var undefined",
                "$$$$$$(BIG_MONEY)",
                "$$$(BIG_MONEY)",
            ),
            (
                "multiple (even) operators, var defined",
                "$$$$$$(VAR_A)",
                "$$$(VAR_A)",
            ),
            (
                "multiple (odd) operators, var undefined",
                "$$$$$$$(GOOD_ODDS)",
                "$$$$(GOOD_ODDS)",
            ),
            (
                "multiple (odd) operators, var defined",
                "$$$$$$$(VAR_A)",
                "$$$A",
            ),
            ("missing open expression", "$VAR_A)", "$VAR_A)"),
            ("shell syntax ignored", "${VAR_A}", "${VAR_A}"),
            (
                "trailing incomplete expression not consumed",
                "$(VAR_B)_______$(A",
                "B_______$(A",
            ),
            (
                "trailing incomplete expression, no content, is not consumed",
                "$(VAR_C)_______$(",
                "C_______$(",
            ),
            (
                "operator at end of input string is preserved",
                "$(VAR_A)foobarzab$",
                "Afoobarzab$",
            ),
            (
                "shell escaped incomplete expr",
                "foo-\\$(VAR_A",
                "foo-\\$(VAR_A",
            ),
            ("lots of $( in middle", "--$($($($($--", "--$($($($($--"),
            (
                "lots of $( in beginning",
                "$($($($($--foo$(",
                "$($($($($--foo$(",
            ),
            ("lots of $( at end", "foo0--$($($($(", "foo0--$($($($("),
            (
                "escaped operators in variable names are not escaped",
                "$(foo$$var)",
                "$(foo$$var)",
            ),
            ("newline not expanded", "\n", "\n"),
            // Not in the kubelet's table: non-ASCII around operators is kept.
            ("non-ASCII kept", "é$é$(VAR_A)ü", "é$éAü"),
        ];
        let dual = [&first, &second];
        let single = [&one];
        for contexts in [&single[..], &dual[..]] {
            let mapping = mapping_for(contexts);
            for (name, input, want) in cases {
                assert_eq!(expand(input, &mapping), want, "{name}: {input:?}");
            }
        }
    }

    /// The kubelet's `TestMapReference`: a variable sees those declared before
    /// it as expanded.
    #[test]
    fn declared_variables_see_the_earlier_ones_expanded() {
        let mut declared = context(&[("FOO", "bar"), ("ZOO", "$(FOO)-1"), ("BLU", "$(ZOO)-2")]);
        let service = BTreeMap::new();
        for name in ["FOO", "ZOO", "BLU"] {
            let value = declared[name].clone();
            let expanded = expand(&value, &mapping_for(&[&declared, &service]));
            declared.insert(name.to_owned(), expanded);
        }
        assert_eq!(
            declared,
            context(&[("FOO", "bar"), ("ZOO", "bar-1"), ("BLU", "bar-1-2")])
        );
    }
}
