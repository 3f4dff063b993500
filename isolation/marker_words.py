"""The words a canary marker is spelled in: each one token, with its leading space, in the vocabularies measured.

The words of Tekken (Mistral, 131k tokens) and of the simulator's tokenizer (4k tokens trained on Python sources) that
both hold whole: common English and programming words, so that most byte-level BPE vocabularies hold them whole too.
A model whose tokenizer holds fewer of them gets a spelling of the ones it does (spelling.py).
"""

WORDS = tuple(
    """
    ab about above ac accept act ad add adding addition additional address after again against al algorithm all
    allow allowed already also always amt an analyze and another any apart app appe appear appended ar arbit
    arbitrary are aren arg args argument aro array as asp assert associ associated assume assumed assuming at
    att attempt attribu attributes aut auto automatic avail available await back backwards bar bare bas base based
    basic baz be because become been before begin beginning behavior behaviour being ben best better between bid big
    binary blan blank block body bool both brace break bro bu buf buffer buffered build bur but by byte bytes ca
    call calle called caller came can cannot cap capitalize case cases cat cause cer cert certain ch change changed
    char character characters charset check checked chr chunk chunks circular cl class clear cli client clients clip
    clo close closed cls co code codes col collect collections column columns com come comm comment common communic
    comp compact comple complete completed complex compliant con conn connect connection connections cons consequ
    considered consistency consistent constant constants constraint constructor cont contain containing contains
    content context contin continue control conver conversion convert converted corre correct could count create csv
    cur current cust custom customize dat data datatype day de deal decimal decode decoded decoder decoding deep
    deeper def default define defined definit del delim delimiter dep deprecated descri details detected determ
    determine determined devote di diagram dialect dict diction different digits directly dis discard do doc
    document does doesn doing don done double drop due during each eas edge effect either element elif elim else em
    email empty en enable enc enclosed encode encoded encoder encoding end enforce ensure ent entire enumerate equ
    equival equivalent err errno error es esc escape established eval evalu even ever every everything ex example
    exc excel except exception exists exp expand expanded expect expected expecting explicit explicitly exposed ext
    extra fact fail failed fall false fast feat fet fetch few field fil file files fill finally find first fit fits
    fix flag flags float floats flush fol follow followed following foo for forget form format forms found fp fr
    freq frequ frequencies frequency fro from full function funk fur further ge get gets gi given go goal goes going
    got group groups hack hand handle happ happen has have he header headers here hi hit ho hold host how http https
    id ident identifier ids idx ie if ig ignore ill imp implement implemented implements implies import in inclu
    incom incon incre inde indent independent index indicate indicates infin info initial injection input insert
    inside instance instead int integ integers intent inter interface intern into invalid io is isinstance iso issu
    issue issued it item items iter iteration iterator its join json just keep key keys keyword know kwargs lab larg
    large larger last later lay le leading least left len length less letter letters level li lib library like
    likely lim limit limited line lines list literal litt little loc local long longe longer look looked loop lost
    low lowercase lr lst ma made main maintain make man manual many mapping margin mark marker markers mat match
    matches matching max may me meaning means meet meets mem memo message meta method methods might mime min mo mod
    mode modes module more most msg much mult multiple must mv name named names ne necess necessary need needed
    needs negative net new newline next nil no non normal not note nothing now null number ob obj object objects obs
    occur occurs of off offici often ok old older omit on one only onto open oper optim option optional or ord order
    other otherwise out output over override pac packet page pair pairs par paragraph parse parser parsing part
    partial pas pass passed passes past path paths pattern peek per perc percent pers persistent phase pick pip
    pipeline place placeholder plat po point pointer port pos position possible pote potential pr pre predicate
    prefer prefix present prev prevent previous pri print prior pro prob probable probably process properties
    property protocol provided proxy public punct put py qu quote quoted quotes quoting raise raised raises range
    raw re read readable reader reading real reason recogn recognize recognized recursion redirected reference
    references reg regex regexp rel remain remember remove removed replace repr repre represent requ request
    requested requests reset response rest restrict result resulting retrieved return returned returning returns
    reused rever reversed right ro rough roughly row rows rule rules safe same sample san satis satisfied satisfy
    save says scan scanner sco se sec second see selected self sen send sending sent sentence sep separ separator
    sequence seri server servers set sh sho short should si simply since single site sites size skip skipped sm
    small sniff so sock socket solely some sort sorted source sp space spaces spe speaking spec speci specific
    specified specifies split splits sque ssl st stand standard start started starting state states status still sto
    str stream strict string strings struct stuff su sub subclass subclasses subsequent subtract such sum sup super
    supp support supporting supports sur sure switch sy sys tab table tabs tak take taken takes te tel tell template
    test tests text th than that the their them then there these they this tho those threshold through time timeout
    times to token too top toss total towards tr tra trailer trailing trans transfer tre treated true try tunnel
    tuple tuples tur twe twice two typ type types un under underlying uni unicode unix unless until up updated ur
    url urllib us use used useful user uses using usu usual val valid value values vari variable ver version vi via
    want wants warnings was wasn way we wh what when where whether which while whitespace who wi width will win wind
    winner with within without won wor word words world would wr wrap wrapped wrapping writer wrong yield you zero
    """.split()
)
